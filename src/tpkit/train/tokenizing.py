"""Documents -> token ids, the one path of `tpkit prepare-data` and of `tpkit train
--data` on a .jsonl, .parquet or `datasets` folder:

    Tokenized(files, "bytes")     the sources opened and checked (`text_sources`)
    for ids, n, mask in tokenized:  each piece's ids (an end-of-sequence id after each
        ...                       document), n: the bytes of the source it covers, mask:
                                  1 per assistant token of a chat (None: not chat data)
    tokenized.documents           counted as they go; a source without one is an error
    tokenized.mask_problem        why some chat has no mask (None: every chat has one)

Each document is tokenized with the model's own tokenizer (`AutoTokenizer` over a
folder's tokenizer files; "bytes" for tpkit's byte-level presets), `workers` processes
at a time when asked (the same ids, in the same order).
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator
from functools import lru_cache

import numpy as np

from tpkit.spec.errors import UserError
from tpkit.train.chat_mask import ChatText, encode_with_mask, render
from tpkit.train.text_sources import Fields, Source, documents, open_sources
from tpkit.train.tokens import DTYPES, dtype_for
from tpkit.weights.tokenizer import ByteTokenizer, has_tokenizer, load_tokenizer

BATCH_BYTES = 1 << 20  # text handed to the tokenizer (or a worker) at a time


@lru_cache(maxsize=2)
def tokenizer(where: str):
    """The tokenizer of a model folder, or 'bytes' (loaded once per process)."""
    if where == "bytes":
        return ByteTokenizer()
    if not has_tokenizer(where):
        raise UserError(f"{where}: no tokenizer files (tokenizer.json, tokenizer.model, "
                        f"vocab.json or vocab.txt); give a model folder or 'bytes'")
    return load_tokenizer(where)


class Tokenized:
    """The token ids of `files`, piece by piece (iterate once); opening checks the
    tokenizer, the chat template and every source before anything is tokenized."""

    def __init__(self, files: list[str], tokenizer_at: str, text_field: str = "text",
                 chat_field: str | None = None, workers: int = 1,
                 choose: str | None = None) -> None:
        if workers < 1:
            raise UserError(f"--workers={workers} must be a positive number of processes")
        self.tokenizer_at, self.workers = tokenizer_at, workers
        self.tok = tokenizer(tokenizer_at)
        render = _chat_renderer(tokenizer_at, chat_field) if chat_field else None
        self.fields = Fields(text_field, chat_field, render, *([choose] if choose else []))
        self.sources = open_sources(files, self.fields)
        self.eos = self.tok.eos_ids[:1]  # after each document
        self.documents, self.mask_problem = 0, None

    def __iter__(self) -> Iterator[tuple[list[int], int, list[int] | None]]:
        docs, has_text, eos = [0] * len(self.sources), False, self.eos
        batches = _batches(self.sources, self.fields)
        chat = self.fields.chat is not None
        for batch, encoded in _encoded(batches, self.tokenizer_at, self.workers):
            for (text, n, last, k), (piece, mask, problem) in zip(batch, encoded):
                has_text = has_text or bool(text.strip())
                ends = last and has_text  # an empty document is no document
                docs[k] += ends
                has_text = has_text and not last
                self.mask_problem = self.mask_problem or problem
                ids = list(piece) + (eos if ends else [])
                # the end-of-sequence id after a chat is no turn of the assistant's
                yield ids, n, ((mask or [0] * len(piece)) + [0] * (len(ids) - len(piece))
                               if chat else None)
        empty = [str(s.path) for s, d in zip(self.sources, docs) if d == 0]
        if empty:
            raise UserError(f"no usable text in {', '.join(empty)} (field "
                            f"{self.fields.name!r}: every document is empty)")
        self.documents = sum(docs)

    def array(self) -> np.ndarray:
        """Every id at once (uint16 when the vocabulary fits, else uint32)."""
        dtype = DTYPES[dtype_for(self.tok.vocab_size)]
        parts = [np.asarray(ids, dtype=dtype) for ids, _, _ in self]
        return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _encode(job: tuple[str, list[str]]) -> list[tuple]:
    """(token ids, assistant mask or None, why no mask or None) of each text (in a worker
    process, or here); a rendered chat's mask from its assistant spans (`chat_mask`)."""
    where, texts = job
    tok = tokenizer(where)
    return [encode_with_mask(tok.hf, t) if isinstance(t, ChatText) and t else
            (tok.encode(t, special=False) if t else [], None, None) for t in texts]


def _chat_renderer(where: str, field: str) -> Callable[[list], str]:
    hf = getattr(tokenizer(where), "hf", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise UserError(f"--chat-field {field}: the tokenizer {where} has no chat template")
    return lambda messages: render(hf, messages)


def _batches(sources: list[Source], fields: Fields) -> Iterator[list[tuple]]:
    """Pieces (text, bytes, ends a document, source index), about BATCH_BYTES a batch."""
    batch, size = [], 0
    for k, src in enumerate(sources):
        for text, n, last in documents(src, fields):
            batch.append((text, n, last, k))
            size += len(text)
            if size >= BATCH_BYTES:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _encoded(batches: Iterator[list[tuple]], where: str, workers: int) -> Iterator[tuple]:
    """(batch, ids of each piece), in order; tokenized by `workers` processes."""
    if workers <= 1:
        for b in batches:
            yield b, _encode((where, [p[0] for p in b]))
        return

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending: deque = deque()
        for b in batches:
            pending.append((b, pool.apply_async(_encode, ((where, [p[0] for p in b]),))))
            if len(pending) > 2 * workers:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()
