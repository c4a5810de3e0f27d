"""Text in, text out: `model.generate("text")` with the tokenizer the model carries.

    model = tpkit.load("path/to/hf-dir")                 # model.tokenizer: its own
    model.generate("Tensor parallelism", max_new_tokens=20)          -> "splits ..."
    model.generate(["a", "b"], max_new_tokens=20, temperature=0.8)   -> ["...", "..."]
    for piece in model.generate("a", max_new_tokens=20, stream=True): print(piece, end="")

A prompt is encoded as `tpkit generate --prompt` encodes it (the tokenizer's BOS
included); the tokens are `model.generate`'s on ids (`tpkit.decode.generate`: the same
greedy or sampled tokens), stopping at the tokenizer's end-of-sequence ids unless
`eos_id` says otherwise; the text is each row's new tokens up to its first
end-of-sequence id, decoded without special tokens. `stream=True` (one prompt) yields
the text as it is produced, generated in a thread (its errors raised here). The
tokenizer is duck-typed (encode, decode, eos_ids, pad_id, stream: `tpkit.weights.tokenizer`),
attached by `tpkit.load`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

from tpkit.spec.errors import UserError


def is_text(prompts) -> bool:
    """A string, or a non-empty list of strings."""
    return isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and bool(prompts)
                                        and all(isinstance(p, str) for p in prompts))


def generate_text(model, prompts, max_new_tokens: int, stream: bool = False, **kw):
    """The text after `prompts` (a string: a string; a list: a list), or with `stream` an
    iterator of its pieces; keywords as `model.generate` takes them."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise UserError("this model carries no tokenizer (its folder has no tokenizer files): "
                        "give token ids, or load a folder or checkpoint with one")
    one = isinstance(prompts, str)
    ids = [tok.encode(p) for p in ([prompts] if one else prompts)]
    kw.setdefault("eos_id", list(tok.eos_ids) or None)
    kw.setdefault("pad_id", tok.pad_id)
    stops = _stops(kw["eos_id"])
    if stream:
        if not one:
            raise UserError("stream=True takes one prompt (a string), not a list")
        return _pieces(model, ids, max_new_tokens, tok, stops, kw)
    out = model.generate(ids, max_new_tokens, **kw)
    texts = [tok.decode(_until(row, stops)) for row in out[:, -max_new_tokens:].tolist()] \
        if max_new_tokens else [""] * len(ids)
    return texts[0] if one else texts


def _stops(eos_id) -> set[int]:
    return set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)


def _until(row: list[int], stops: set[int]) -> list[int]:
    """The tokens of a row before its first end-of-sequence id."""
    end = next((i for i, t in enumerate(row) if t in stops), len(row))
    return row[:end]


def _pieces(model, ids: list[list[int]], n: int, tok, stops: set[int],
            kw: dict) -> Iterator[str]:
    """The text of one prompt's new tokens as they arrive (generated in a thread)."""
    arrived: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            with torch.no_grad():
                model.generate(ids, n, on_tokens=arrived.put, **kw)
            arrived.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            arrived.put(e)

    threading.Thread(target=run, daemon=True, name="tpkit-generate").start()
    text, ended = tok.stream(), False
    while (item := arrived.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        ended = ended or item[0] in stops
        piece = "" if ended else text.push(item[:1])
        if piece:
            yield piece
    if tail := text.flush():
        yield tail
