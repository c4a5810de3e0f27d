"""Tokenizers: a model folder's own (Hugging Face), or tpkit's byte level.

    tok = load_tokenizer("path/to/hf-dir")        # AutoTokenizer over its tokenizer files
    tok = load_tokenizer("runs/x/checkpoints/step_000100")   # files copied there, else bytes
    ids = tok.encode("Tensor parallelism")        # list[int]
    text = tok.decode(ids)

tpkit's own presets (gpt2-tiny, llama-tiny) are trained on UTF-8 bytes: ids 0..255
are the bytes, and a folder without tokenizer files is read that way. An exported
Hugging Face folder of such a model gets `save_byte_tokenizer`: a `tokenizer.json`
that `AutoTokenizer` loads and that maps text to exactly the same ids.
"""

from __future__ import annotations

import json
import re
import shutil
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tpkit.spec.config import PRESETS
from tpkit.spec.errors import UserError

# The files a Hugging Face tokenizer may consist of, and the generation settings (EOS
# and pad ids) that transformers' generate reads: copied along with a model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "added_tokens.json", "chat_template.jinja", "generation_config.json")
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # one suffices


class Tokenizer(Protocol):
    """What generation and data preparation need of a tokenizer."""

    vocab_size: int
    eos_ids: list[int]  # generation stops at any of them
    pad_id: int

    def encode(self, text: str, special: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (ids >= 256 decode to nothing)."""

    vocab_size, eos_ids, pad_id = 256, [], 0

    def encode(self, text: str, special: bool = True) -> list[int]:
        """The UTF-8 bytes of `text` (`special` has no meaning here)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; invalid UTF-8 replaced by U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream(self) -> TextStream:
        """An incremental decoder of this tokenizer's ids."""
        return TextStream(self)

    def token_bytes(self, token: int) -> bytes:
        """The byte a token stands for (none for ids >= 256)."""
        return bytes([token]) if 0 <= token < 256 else b""

    @staticmethod
    def array(text: str) -> np.ndarray:
        """`encode(text)` as a uint16 array (a corpus at once, without a Python list)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


class HFTokenizer:
    """A Hugging Face tokenizer (`AutoTokenizer.from_pretrained(folder)`)."""

    def __init__(self, folder: str | Path) -> None:
        # lazy: optional (tpkit[hf])
        from transformers import AutoTokenizer

        self.folder = str(folder)
        gen_file = Path(folder) / "generation_config.json"  # what transformers' generate uses
        try:
            self.hf = AutoTokenizer.from_pretrained(self.folder)
            gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        except Exception as e:  # noqa: BLE001 - damaged files raise anything (JSON, KeyError,
            # the Rust parser's Exception): one line naming the folder
            said = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UserError(f"{folder}: its tokenizer files cannot be read "
                            f"({type(e).__name__}: {said[:200]})") from None
        if not isinstance(gen, dict):
            raise UserError(f"{gen_file}: a JSON {type(gen).__name__}, not an object")
        self.vocab_size = len(self.hf)
        eos = gen.get("eos_token_id", self.hf.eos_token_id)
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.pad_id = next((i for i in (gen.get("pad_token_id"), self.hf.pad_token_id,
                                        *self.eos_ids) if i is not None), 0)
        self._byte_level: bool | None = None  # decided on first use (`token_bytes`)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; `special`: with the BOS/EOS the tokenizer adds to a prompt."""
        return list(self.hf(text, add_special_tokens=special)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens left out."""
        return self.hf.decode(ids, skip_special_tokens=True)

    def stream(self) -> TextStream:
        """An incremental decoder of this tokenizer's ids."""
        return TextStream(self)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character, maybe; none for a
        special token): byte-level BPE symbols mapped back to bytes, SentencePiece's
        <0xNN> byte tokens and its word pieces (U+2581 a space)."""
        if token in self.hf.all_special_ids:
            return b""
        sym = self.hf.convert_ids_to_tokens(token) or ""
        if (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", sym)) is not None:
            return bytes([int(m.group(1), 16)])
        if self._byte_level is None:  # a fast tokenizer says how it decodes
            backend = getattr(self.hf, "backend_tokenizer", None)
            d = (json.loads(backend.to_str()).get("decoder") or {}) if backend else {}
            self._byte_level = "ByteLevel" in {x.get("type") for x in [d, *d.get("decoders", [])]}
        if self._byte_level:
            back = _unicode_to_bytes()
            return bytes(back[c] for c in sym if c in back)
        return sym.replace("\u2581", " ").encode("utf-8")


def has_tokenizer(folder: str | Path) -> bool:
    """Does `folder` hold Hugging Face tokenizer files?"""
    folder = Path(folder)
    return folder.is_dir() and any((folder / f).is_file() for f in _VOCAB_FILES)


def load_tokenizer(folder: str | Path | None) -> Tokenizer:
    """The tokenizer of a model folder (HF files), else tpkit's byte-level one."""
    if folder is not None and has_tokenizer(folder):
        return HFTokenizer(folder)
    return ByteTokenizer()


def copy_tokenizer(src: str | Path, dest: str | Path) -> list[str]:
    """Copy the tokenizer files of folder `src` into `dest` (each via a temporary name,
    so no half-written file is left); returns the names copied."""
    src, dest = Path(src), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            tmp = dest / f".{name}.tmp"
            shutil.copyfile(src / name, tmp)
            tmp.replace(dest / name)
            copied.append(name)
    return copied


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character of each byte (what `ByteLevel` expects)."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in kept]
    chars = {b: chr(b) for b in kept}
    chars.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return chars


@cache
def _unicode_to_bytes() -> dict[str, int]:
    """The inverse: the byte each stand-in character means."""
    return {c: b for b, c in _bytes_to_unicode().items()}


def save_byte_tokenizer(folder: str | Path) -> Path:
    """Write a byte-level `tokenizer.json` (+ config) into `folder`: AutoTokenizer loads it
    and encodes text to its UTF-8 bytes, exactly as `ByteTokenizer`."""
    # lazy: optional (tpkit[hf])
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _unicode_to_bytes()  # one token per byte, no merges
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(folder))
    return Path(folder)


def export_tokenizer(source: Any, out: str | Path, model_name: str) -> str:
    """Give an exported Hugging Face folder `out` its tokenizer: the files of the source
    folder if it has them (a Hugging Face folder, or a checkpoint of a `--from-hf` run),
    else for one of tpkit's presets (trained on bytes) the byte-level tokenizer.
    Returns what was done: 'copied', 'bytes' or 'none' (a model of unknown tokenizer)."""
    if isinstance(source, (str, Path)) and has_tokenizer(source):
        copy_tokenizer(source, out)
        return "copied"
    if model_name in PRESETS:
        save_byte_tokenizer(out)
        return "bytes"
    return "none"


class TextStream:
    """Incremental detokenization: feed ids as they arrive, get the new text.

    The whole sequence is decoded each time (a BPE merge or a multi-byte character
    can change the end), and text ending in U+FFFD waits for the next id.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def push(self, ids: list[int]) -> str:
        """New ids -> the text not yet returned ('' while a character is incomplete)."""
        self.ids += ids
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[self.shown:], len(text)
        return new

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character as U+FFFD)."""
        text = self.tokenizer.decode(self.ids)
        new, self.shown = text[self.shown:], len(text)
        return new


def bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """The most UTF-8 bytes of text one token stands for, where the tokenizer bounds it:
    a text of n bytes then has at least ceil(n / it) tokens (a server refuses one too
    long for its context before tokenizing it). Bounded: the byte tokenizer (1), a
    byte-level BPE without a normalizer (its longest token or added token); None for any
    other (a normalizer may shrink the text, unknown characters fuse into one token...)."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    hf = getattr(tokenizer, "hf", None)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or \
            type(backend.model).__name__ != "BPE" or \
            type(backend.pre_tokenizer).__name__ != "ByteLevel":
        return None
    added = [len(t.content.encode("utf-8")) for t in hf.added_tokens_decoder.values()]
    return max([1, *added, *(len(tokenizer.token_bytes(i)) for i in range(len(hf)))])
