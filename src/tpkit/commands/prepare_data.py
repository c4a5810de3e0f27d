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
summary (documents, tokens, vocabulary, dtype; `tpkit.train.tokens`). Chats
(--chat-field) also get a mask of the assistant's tokens next to each shard
(`tpkit.train.chat_mask`), which `tpkit train --loss-on assistant` trains on. The readers are
`tpkit.train.text_sources`, the tokenizing `tpkit.train.tokenizing` (which `tpkit train
--data FILE.jsonl` uses too). `--workers N` tokenizes in N processes (the same shards,
in the same order). A progress bar follows the bytes read and the tokens per second.

--out is locked (the lock of a run folder) and written as a hidden sibling swapped into
place at the end (`tpkit.train.data_folder`): an interrupted run leaves --out as it
was; a folder that is not empty must be prepared data, and replacing it takes --overwrite.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
from rich.progress import TimeRemainingColumn as Eta

from tpkit.commands.common import group
from tpkit.spec.words import plural


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
    out.add_argument("--overwrite", action="store_true",
                     help="replace the data prepared earlier in --out")


@contextmanager
def byte_progress(total: int, enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar over `total` bytes with tokens and tokens/s (or nothing);
    yields advance(bytes, tokens)."""
    if not enabled:
        yield lambda n, t: None
        return

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
            chat_field: str | None = None, workers: int = 1, overwrite: bool = False) -> dict:
    """Tokenize `files` into shards under `out`, an end-of-sequence token after each
    document; returns the index (with documents, tokens, vocab_size, dtype). Every input
    is checked before --out is touched; `out` is replaced whole, or left as it was."""
    # lazy: torch; the command parses and checks its flags without it
    from tpkit.train.data_folder import replacing
    from tpkit.train.tokenizing import Tokenized
    from tpkit.train.tokens import MASK_KEY, ShardWriter, dtype_for

    pieces = Tokenized(files, tokenizer_at, text_field, chat_field, workers)
    dtype_for(pieces.tok.vocab_size, dtype)  # a dtype too small: said before --out is touched
    meta = dict(tokenizer=tokenizer_at, eos_id=pieces.eos[0] if pieces.eos else None,
                sources=[str(s.path) for s in pieces.sources], field=pieces.fields.name,
                chat=chat_field is not None)
    chat = chat_field is not None  # a mask of the assistant's tokens next to the ids
    with replacing(Path(out), overwrite) as folder, ShardWriter(
            folder, pieces.tok.vocab_size, dtype, shard_tokens, meta=meta,
            masked=chat) as writer:
        with byte_progress(sum(s.size for s in pieces.sources), progress) as advance:
            for ids, n, mask in pieces:
                writer.write(ids, mask)
                advance(n, len(ids))
        writer.meta["documents"] = pieces.documents
        if chat:
            writer.meta[MASK_KEY] = pieces.mask_problem is None
            writer.meta |= {"assistant_mask_problem": pieces.mask_problem} \
                if pieces.mask_problem else {}
        return writer.close()


def run(args: argparse.Namespace) -> int:
    """Prepare the token shards; bad input is a UserError (one line, exit 2, `tpkit.cli`)."""
    index = prepare(args.files, args.tokenizer, args.out, args.dtype, args.shard_tokens,
                    not args.no_progress, args.text_field, args.chat_field, args.workers,
                    args.overwrite)
    print(f"{plural(index['documents'], 'document', fmt=',')}, "
          f"{plural(index['tokens'], 'token', fmt=',')} ({index['dtype']}, "
          f"vocab_size={index['vocab_size']}) in {plural(len(index['shards']), 'shard')} "
          f"under {args.out}")
    return 0
