"""`tpkit prepare-data`: text, JSON Lines, Parquet or a `datasets` folder -> token shards
a training run reads memory-mapped.

    tpkit prepare-data corpus/*.txt --tokenizer path/to/hf-model --out data/corpus
    tpkit prepare-data train.jsonl --text-field content --tokenizer MODEL --out data/c
    tpkit prepare-data chats.parquet --chat-field messages --tokenizer MODEL --out data/chat
    tpkit prepare-data saved-dataset/ --tokenizer MODEL --out data/ds --workers 8
    tpkit train --from-hf path/to/hf-model --data data/corpus --tp 2 --pp 2 ...

Each document (a .txt file, a JSON line, a row) is tokenized with the model's own
tokenizer (`AutoTokenizer` over the folder's tokenizer files; `--tokenizer bytes` for
tpkit's byte-level presets), followed by the tokenizer's end-of-sequence token, into
shards of uint16 ids when the vocabulary fits (else uint32) and an index.json with a
summary (documents, tokens, vocabulary, dtype; `tpkit.train.tokens`). The readers are
`tpkit.train.text_sources`. `--workers N` tokenizes in N processes (the same shards,
in the same order). A progress bar follows the bytes read and the tokens per second.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache

from tpkit.commands.common import group
from tpkit.spec.errors import UserError
from tpkit.spec.words import plural
from tpkit.train.text_sources import Fields, Source, documents, open_sources

BATCH_BYTES = 1 << 20  # text handed to the tokenizer (or a worker) at a time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit prepare-data`."""
    parser.add_argument("files", nargs="+", help="inputs: .txt (any other suffix: UTF-8 "
                        "text), .jsonl, .parquet, or a `datasets` save_to_disk folder")
    group(parser, "model").add_argument(
        "--tokenizer", required=True, metavar="DIR",
        help="a model folder with tokenizer files, or 'bytes'")
    data = group(parser, "data")
    data.add_argument("--text-field", default="text", metavar="NAME",
                      help="the field (.jsonl) or column (.parquet, datasets) of the text")
    data.add_argument("--chat-field", default=None, metavar="NAME",
                      help="a field of messages ([{role, content}, ...]) rendered with the "
                           "tokenizer's chat template, instead of --text-field (default: none)")
    data.add_argument("--workers", type=int, default=1, metavar="N",
                      help="tokenizer processes (for large inputs)")
    out = group(parser, "logging")
    out.add_argument("--out", required=True, metavar="DIR",
                     help="output folder (shards + index.json)")
    out.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"),
                     help="token dtype (auto: uint16 when the vocabulary fits)")
    out.add_argument("--shard-tokens", type=int, default=1 << 26, metavar="N",
                     help="tokens per shard")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


@lru_cache(maxsize=2)
def tokenizer(where: str):
    """The tokenizer of a model folder, or 'bytes' (loaded once per process)."""
    from tpkit.checkpoint.tokenizer import ByteTokenizer, has_tokenizer, load_tokenizer

    if where == "bytes":
        return ByteTokenizer()
    if not has_tokenizer(where):
        raise UserError(f"{where}: no tokenizer files (tokenizer.json, tokenizer.model, "
                        f"vocab.json or vocab.txt); give a model folder or 'bytes'")
    return load_tokenizer(where)


def _encode(job: tuple[str, list[str]]) -> list[list[int]]:
    """Token ids of each text (in a worker process, or here)."""
    where, texts = job
    tok = tokenizer(where)
    return [tok.encode(t, special=False) if t else [] for t in texts]


def _chat_renderer(where: str, field: str) -> Callable[[list], str]:
    hf = getattr(tokenizer(where), "hf", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise UserError(f"--chat-field {field}: the tokenizer {where} has no chat template")
    return lambda messages: hf.apply_chat_template(messages, tokenize=False)


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
    import multiprocessing

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


@contextmanager
def byte_progress(total: int, enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar over `total` bytes with tokens and tokens/s (or nothing);
    yields advance(bytes, tokens)."""
    if not enabled:
        yield lambda n, t: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
    from rich.progress import TimeRemainingColumn as Eta

    start, seen = time.perf_counter(), [0]
    with Progress(TextColumn("tokenize"), BarColumn(), DownloadColumn(), Eta(),
                  TextColumn("{task.fields[info]}")) as bar:
        task = bar.add_task("tokenize", total=total, info="")

        def advance(n: int, tokens: int) -> None:
            seen[0] += tokens
            rate = seen[0] / max(time.perf_counter() - start, 1e-9)
            bar.update(task, advance=n, info=f"{seen[0]:,} tokens  {rate:,.0f} tok/s")

        yield advance


def prepare(files: list[str], tokenizer_at: str, out: str, dtype: str = "auto",
            shard_tokens: int = 1 << 26, progress: bool = True, text_field: str = "text",
            chat_field: str | None = None, workers: int = 1) -> dict:
    """Tokenize `files` into shards under `out`, an end-of-sequence token after each
    document; returns the index (with documents, tokens, vocab_size, dtype)."""
    from tpkit.train.tokens import ShardWriter

    if workers < 1:
        raise UserError(f"--workers={workers} must be a positive number of processes")
    tok = tokenizer(tokenizer_at)
    render = _chat_renderer(tokenizer_at, chat_field) if chat_field else None
    fields = Fields(text_field, chat_field, render)
    sources = open_sources(files, fields)
    eos = tok.eos_ids[:1]  # after each document
    writer = ShardWriter(out, tok.vocab_size, dtype, shard_tokens,
                         meta=dict(tokenizer=tokenizer_at, eos_id=eos[0] if eos else None,
                                   sources=[str(s.path) for s in sources],
                                   field=fields.name, chat=chat_field is not None))
    docs, has_text = [0] * len(sources), False
    with byte_progress(sum(s.size for s in sources), progress) as advance:
        for batch, ids in _encoded(_batches(sources, fields), tokenizer_at, workers):
            for (text, n, last, k), piece in zip(batch, ids):
                has_text = has_text or bool(text.strip())
                ends = last and has_text  # an empty document is no document
                writer.write(list(piece) + (eos if ends else []))
                docs[k] += ends
                has_text = has_text and not last
                advance(n, len(piece) + (len(eos) if ends else 0))
    empty = [str(s.path) for s, d in zip(sources, docs) if d == 0]
    if empty:
        raise UserError(f"no usable text in {', '.join(empty)} (field {fields.name!r}: "
                        f"every document is empty)")
    writer.meta["documents"] = sum(docs)
    return writer.close()


def run(args: argparse.Namespace) -> int:
    """Prepare the token shards; bad input is a UserError (one line, exit 2, `tpkit.cli`)."""
    index = prepare(args.files, args.tokenizer, args.out, args.dtype, args.shard_tokens,
                    not args.no_progress, args.text_field, args.chat_field, args.workers)
    print(f"{plural(index['documents'], 'document', fmt=',')}, "
          f"{plural(index['tokens'], 'token', fmt=',')} ({index['dtype']}, "
          f"vocab_size={index['vocab_size']}) in {plural(len(index['shards']), 'shard')} "
          f"under {args.out}")
    return 0
