"""Training data: the embedded corpus, byte-level tokens, and a dp-aware loader.

The default corpus ships with Python itself: `pydoc_data.topics` (the text of the
language reference's help topics, ~465 KB), so `tpkit train` needs no download.
Tokens are bytes (vocab 256, the size of gpt2-tiny and llama-tiny). `--data PATH`
takes a UTF-8 text file, a directory of .txt files, a .bin of uint16 token ids, a folder
written by `tpkit prepare-data` (any tokenizer; shards read memory-mapped, see
`tpkit.train.tokens`), or a .jsonl, .parquet or `datasets` folder, tokenized with the
model's tokenizer (bytes, or --from-hf's) as `prepare-data` would (`tpkit.train.tokenizing`,
the same code).

The loader cuts the token stream into windows of seq+1 tokens (inputs and the
same shifted by one as labels), shuffles them per epoch with a fixed seed, and at
each step takes the next `global_batch` of them:

    global batch of step t:  [ dp0: b | dp1: b | ... ]    b = global_batch / dp
    every tp rank and pp stage of replica d reads the same slice (no broadcast)

Its state is one number, the position in that stream, saved with checkpoints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import torch

from tpkit.parallel.schedules import MicroBatch
from tpkit.spec.errors import UserError
from tpkit.train.text_sources import DATASETS, documents_kind, read_text
from tpkit.train.tokenizing import Tokenized
from tpkit.train.tokens import INDEX, MASK_KEY, TokenStream, open_masks, open_shards, read_index
from tpkit.weights.tokenizer import ByteTokenizer, has_tokenizer

IGNORED = -100  # a label without a loss (the cross-entropy's ignore_index)
EMBEDDED_PROMPT = 'The "return" statement'  # a heading of the embedded corpus (the demo's hint)


def embedded_text() -> str:
    """The text of Python's help topics, in a fixed order."""
    return "\n\n".join(topics[k] for k in sorted(topics))


def encode_bytes(text: str) -> np.ndarray:
    """The byte tokenizer's ids of `text` (`model.tokenizer.ByteTokenizer`), as uint16."""
    return ByteTokenizer.array(text)


def load_tokens(path: str | Path | None, vocab_size: int = 256,
                tokenizer: str | None = None, warn: bool = False) -> np.ndarray | TokenStream:
    """Token ids of the corpus at `path` (None: the embedded one); clear errors.

    A `prepare-data` folder is checked before the first step: its index, every shard's
    largest id (one pass over the memory maps: an index that lies is caught) against
    `vocab_size`, and the tokenizer it names against the model's (`tokenizer`: a folder
    or "bytes"; None: unknown) — a different one with another vocabulary size is an
    error, with the same size a warning (`warn`) naming both."""
    if path is None:
        tokens = encode_bytes(embedded_text())
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"data file {p} does not exist")
        if p.is_dir() and (p / INDEX).is_file():
            return check_shards(p, vocab_size, tokenizer, warn)
        tokens = _read(p, tokenizer)
        if tokens.size == 0:
            raise UserError(f"data file {p} is empty (0 tokens)")
    top = int(tokens.max())
    if top >= vocab_size:
        raise UserError(f"token id {top} in the data is out of the model's vocab_size="
                         f"{vocab_size}")
    return tokens


def _read(p: Path, tokenizer: str | None) -> np.ndarray:
    """The ids of a data file or folder that is not prepared data, read by what it is."""
    kind = documents_kind(p)
    if kind is not None:
        return _documents(p, kind == DATASETS, tokenizer)
    if p.is_dir() and any(p.glob("*shard_*.bin*")):
        raise UserError(f"data folder {p} holds token shards but no {INDEX}: an interrupted "
                        f"or concurrent `tpkit prepare-data`; prepare the data again")
    if p.is_dir():
        files = sorted(p.glob("*.txt"))
        if not files:
            raise UserError(f"data directory {p} holds no .txt file")
        return encode_bytes("\n\n".join(read_text(f) for f in files))
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise UserError(f"data file {p} has an odd size ({p.stat().st_size} bytes); "
                            f"a .bin holds uint16 token ids")
        return np.fromfile(p, dtype=np.uint16)
    return encode_bytes(read_text(p))


def read_by_the_model(data: str | Path | None) -> bool:
    """Whether `data` is ids of the model's own tokenizer: a `prepare-data` folder, or a
    .jsonl, .parquet or datasets folder (tokenized here with it, as prepare-data does);
    other data (text, .bin) is bytes."""
    return bool(data) and ((Path(data) / INDEX).is_file() or
                           documents_kind(Path(data)) is not None)


def _documents(p: Path, folder: bool, tokenizer: str | None) -> np.ndarray:
    """A .jsonl, .parquet or datasets folder, tokenized as `prepare-data` does."""
    prepare = f"tpkit prepare-data {p} --tokenizer {tokenizer or 'TOKENIZER'} --out DIR"
    if tokenizer is None:
        raise UserError(f"data {p} ({'a datasets folder' if folder else p.suffix}) needs the "
                        f"model's tokenizer, which tpkit does not know here: run `{prepare}` "
                        f"with the model's tokenizer, then train on --data DIR")
    return Tokenized([str(p)], tokenizer, choose=f"train reads the field 'text'; for "
                     f"another, run `{prepare} --text-field NAME`, then train on --data "
                     f"DIR").array()


def check_shards(folder: Path, vocab_size: int, tokenizer: str | None = None,
                 warn: bool = False) -> TokenStream:
    """A prepare-data folder, memory-mapped, with its ids and tokenizer checked."""
    tokens, index = open_shards(folder)
    if len(tokens) == 0:
        raise UserError(f"data folder {folder} is empty (0 tokens)")
    _same_tokenizer(folder, index, vocab_size, tokenizer, warn)
    if index["max_id"] >= vocab_size:
        raise UserError(f"token id {index['max_id']} in the data {folder} (tokenizer "
                        f"vocab_size={index['vocab_size']}) is out of the model's "
                        f"vocab_size={vocab_size}")
    names = [s["file"] for s in index["shards"] if s["tokens"]]
    for name, part in zip(names, tokens.parts):  # one pass: the index may lie
        top = int(part.max())
        if top >= vocab_size or top > index["max_id"]:
            raise UserError(f"{folder / name} holds token id {top}, but {INDEX} says max_id="
                            f"{index['max_id']} and the model's vocab_size={vocab_size}: "
                            f"the index is wrong; prepare the data again")
    return tokens


def _same_tokenizer(folder: Path, index: dict, vocab_size: int, mine: str | None,
                    warn: bool) -> None:
    theirs = index.get("tokenizer")
    if mine is None or theirs is None or _tokenizer_key(theirs) == _tokenizer_key(mine):
        return
    said = (f"the data {folder} was tokenized with {theirs} (vocab_size="
            f"{index['vocab_size']}), the model uses {mine} (vocab_size={vocab_size})")
    if index["vocab_size"] != vocab_size:
        raise UserError(f"{said}: run `tpkit prepare-data ... --tokenizer {mine}` first")
    if warn:
        print(f"warning: {said}: same vocabulary size, but check that the ids mean the same "
              f"tokens", file=sys.stderr, flush=True)


def _tokenizer_key(where: str) -> str:
    return where if where == "bytes" else str(Path(where).resolve())


def tokenizer_folder(data: str | Path | None) -> Path | None:
    """The tokenizer folder a `prepare-data` folder was made with (None: bytes/unknown)."""
    index = Path(data) / INDEX if data is not None else None
    if index is None or not index.is_file():
        return None
    folder = json.loads(index.read_text()).get("tokenizer")
    return Path(folder) if folder and has_tokenizer(folder) else None


def assistant_mask_problem(data: str | Path | None) -> str | None:
    """Why `data` cannot train with the loss on the assistant's tokens only (None: it can,
    or its index is damaged, which reading it says)."""
    need = ("loss_on='assistant' needs chat data with its assistant mask: a `tpkit "
            "prepare-data CHATS.jsonl --chat-field messages --tokenizer MODEL --out DIR` folder")
    index = Path(data) / INDEX if data else None
    if index is None or not index.is_file():
        return f"{need} (data={data} is not a prepare-data folder)"
    try:
        said = json.loads(index.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(said, dict) or said.get(MASK_KEY):
        return None
    if not said.get("chat"):
        return f"{need} (data={data} was prepared from text, not --chat-field)"
    return f"{need} (data={data} has none: {said.get('assistant_mask_problem')})"


def assistant_mask(data: str | Path) -> TokenStream:
    """The assistant mask of a chat folder (1 per token with a loss), memory-mapped."""
    mask = open_masks(data, read_index(Path(data)))
    if mask is None:
        raise UserError(assistant_mask_problem(data) or f"data={data} has no assistant mask")
    return mask


def split_tokens(tokens, val_fraction: float, block: int = 8192, window: int = 1
                 ) -> tuple[TokenStream, TokenStream]:
    """(train, held-out): every k-th block of `block` tokens is held out, k = 1/fraction.

    Interleaved, so the held-out text is drawn from the whole corpus (the end of
    the embedded one is mostly tables, far easier to predict). A corpus of fewer than
    k blocks uses k smaller blocks; one shorter than 2 blocks, or whose held-out part
    would be shorter than one `window` (seq + 1 tokens), holds out its tail instead
    (at least one window, when the corpus has two).
    """
    if val_fraction <= 0:
        return tokens if isinstance(tokens, TokenStream) else TokenStream([tokens]), \
            TokenStream([])
    n, period = len(tokens), max(2, round(1 / val_fraction))
    if n >= 2 * block:
        block = min(block, n // period)  # at least one held-out block
        blocks = [tokens[i:i + block] for i in range(0, n, block)]  # views
        val = [b for i, b in enumerate(blocks) if i % period == period - 1]
        if sum(len(b) for b in val) >= window:
            return (TokenStream([b for i, b in enumerate(blocks) if i % period != period - 1]),
                    TokenStream(val))
    n_val = int(n * val_fraction)
    n_val = max(n_val, window) if n >= 2 * window else n_val
    return TokenStream([tokens[:n - n_val]]), TokenStream([tokens[n - n_val:]])


class TokenLoader:
    """Batches of (ids, labels) [b, s] for one dp replica; resumable by position."""

    def __init__(self, tokens: np.ndarray | TokenStream, seq: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True,
                 name: str = "training", min_windows: int | None = None,
                 split: str = "", mask: TokenStream | None = None) -> None:
        if global_batch % dp_size:
            raise UserError(f"global_batch={global_batch} is not divisible by dp={dp_size}")
        self.tokens = tokens  # read a window at a time (memory-mapped shards stay on disk)
        self.seq, self.global_batch, self.seed, self.shuffle = seq, global_batch, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.windows = max(0, (len(tokens) - 1) // seq)
        need = global_batch if min_windows is None else min_windows  # batches may repeat one
        if self.windows < need:
            what = f"global_batch={global_batch}" if min_windows is None else f"{need}"
            raise UserError(f"{name} data has {len(tokens)} tokens = {self.windows} windows of "
                             f"seq={seq}, fewer than {what}{split}")
        self.position = 0  # sequences consumed, all replicas together
        self._perm: tuple[int, torch.Tensor] | None = None
        self.mask = mask  # 1 per token the loss is on (--loss-on assistant), or None
        self.counted: int | None = None  # labels with a loss in the last global batch

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.windows, generator=g) if self.shuffle else \
                torch.arange(self.windows)
            self._perm = (epoch, perm)
        return self._perm[1]

    def window_ids(self, position: int, dp_rank: int | None = None) -> list[int]:
        """Window indices of this replica's (or `dp_rank`'s) slice of the global batch at
        `position`."""
        b, r = self.global_batch // self.dp_size, self.dp_rank if dp_rank is None else dp_rank
        out = []
        for i in range(position + r * b, position + (r + 1) * b):
            out.append(int(self._order(i // self.windows)[i % self.windows]))
        return out

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, labels), each [global_batch/dp, seq] long; advances the position. With a
        mask, labels without a loss are -100 and `counted` is the number of labels with
        one in the whole global batch (every replica's)."""
        rows = [torch.from_numpy(np.asarray(self.tokens[w * self.seq:w * self.seq + self.seq + 1],
                                            dtype=np.int64))
                for w in self.window_ids(self.position)]
        batch = torch.stack(rows)  # [b, s+1]
        ids, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if self.mask is not None:
            labels[~self._label_mask(self.window_ids(self.position))] = IGNORED
            self.counted = sum(int(self._label_mask(self.window_ids(self.position, r)).sum())
                               for r in range(self.dp_size))
        self.position += self.global_batch
        return ids, labels

    def _label_mask(self, windows: list[int]) -> torch.Tensor:
        """[len(windows), seq] bool: the labels (tokens 1..seq of each window) with a loss."""
        s = self.seq
        return torch.stack([torch.from_numpy(np.asarray(self.mask[w * s + 1:w * s + s + 1],
                                                        dtype=np.bool_)) for w in windows])

    def state_dict(self) -> dict:
        """Position in the stream (and what it depends on)."""
        return dict(position=self.position, seed=self.seed, seq=self.seq,
                    global_batch=self.global_batch, windows=self.windows)

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position (same data, seq and seed)."""
        for k in ("seed", "seq", "windows"):
            if state.get(k, getattr(self, k)) != getattr(self, k):
                raise UserError(_resume_mismatch(k, state[k], getattr(self, k)))
        self.position = int(state["position"])


def _resume_mismatch(key: str, saved, given) -> str:
    """What a resume that changed the loader must say: the flag, and the way out."""
    if key == "windows":
        what = (f"the data must stay the same on resume: the checkpoint's {key} cut it into "
                f"{saved} windows, this run into {given} (--data, --val-fraction, --seq)")
    else:
        what = f"--{key} must stay {saved} on resume (given: {given})"
    return f"{what}; start a new run (another --out) to change it"


def micro_batches(ids: torch.Tensor, labels: torch.Tensor, m: int,
                  divide_by: float | None = None) -> list:
    """Split a replica's batch [b, s] into m micro-batches [b/m, s] (each loss divided by
    `divide_by` when given)."""
    return [MicroBatch(i, y, divide_by) for i, y in zip(ids.chunk(m), labels.chunk(m))]
