"""`tpkit prepare-data`: text files -> token shards a training run reads memory-mapped.

    tpkit prepare-data corpus/*.txt --tokenizer path/to/hf-model --out data/corpus
    tpkit train --from-hf path/to/hf-model --data data/corpus --tp 2 --pp 2 ...

Each file is tokenized with the model's own tokenizer (`AutoTokenizer` over the
folder's tokenizer files; `--tokenizer bytes` for tpkit's byte-level presets) a block
of lines at a time, with the tokenizer's end-of-sequence token after each file, into
shards of uint16 ids when the vocabulary fits (else uint32) and an index.json
(`tpkit.train.tokens`). A progress bar follows the bytes read.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tpkit.spec.errors import UserError

BLOCK_BYTES = 1 << 20  # text tokenized per call (cut at line ends)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit prepare-data`."""
    parser.add_argument("files", nargs="+", help="text files (UTF-8)")
    parser.add_argument("--tokenizer", required=True,
                        help="a model folder with tokenizer files, or 'bytes'")
    parser.add_argument("--out", required=True, help="output folder (shards + index.json)")
    parser.add_argument("--dtype", default="auto", help="auto, uint16 or uint32")
    parser.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per shard")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _tokenizer(where: str):
    from tpkit.model.tokenizer import ByteTokenizer, has_tokenizer, load_tokenizer

    if where == "bytes":
        return ByteTokenizer()
    if not has_tokenizer(where):
        raise UserError(f"{where}: no tokenizer files (tokenizer.json, tokenizer.model, "
                         f"vocab.json or vocab.txt); give a model folder or 'bytes'")
    return load_tokenizer(where)


def check_text(path: Path, sample: int = BLOCK_BYTES, tolerated: float = 0.01) -> None:
    """A UserError when `path` is not UTF-8 text: NUL bytes or invalid UTF-8 in more than
    `tolerated` of its first `sample` bytes (a binary, an archive, a UTF-16 file)."""
    with open(path, "rb") as f:
        data = f.read(sample)
    nul = data.count(b"\0")
    kept = len(data.decode("utf-8", errors="ignore").encode("utf-8"))
    invalid = len(data) - kept  # NUL bytes are valid UTF-8: counted apart
    if data and (nul + invalid) > tolerated * len(data):
        raise UserError(f"{path}: not a text file ({nul:,} NUL bytes and {invalid:,} bytes of "
                        f"invalid UTF-8 in its first {len(data):,} bytes); prepare-data reads "
                        f"UTF-8 text")


def _blocks(path: Path):
    """(text, bytes) blocks of about BLOCK_BYTES, cut after a newline."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            text = f.read(BLOCK_BYTES)
            if not text:
                return
            text += f.readline()  # finish the line: no cut inside a word
            yield text, len(text.encode("utf-8"))


@contextmanager
def byte_progress(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar over `total` bytes (or nothing); yields advance(n)."""
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
    from rich.progress import TimeRemainingColumn as Eta

    with Progress(TextColumn("tokenize"), BarColumn(), DownloadColumn(), Eta()) as bar:
        task = bar.add_task("tokenize", total=total)
        yield lambda n: bar.update(task, advance=n)


def prepare(files: list[str], tokenizer: str, out: str, dtype: str = "auto",
            shard_tokens: int = 1 << 26, progress: bool = True) -> dict:
    """Tokenize `files` into shards under `out`; returns the index."""
    from tpkit.train.tokens import ShardWriter

    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"text files do not exist: {missing}")
    for p in paths:
        check_text(p)
    tok = _tokenizer(tokenizer)
    eos = tok.eos_ids[0] if tok.eos_ids else None  # the end of each file
    writer = ShardWriter(out, tok.vocab_size, dtype, shard_tokens,
                         meta=dict(tokenizer=tokenizer, eos_id=eos,
                                   sources=[str(p) for p in paths]))
    with byte_progress(sum(p.stat().st_size for p in paths), progress) as advance:
        for p in paths:
            for text, n in _blocks(p):
                writer.write(tok.encode(text, special=False))
                advance(n)
            if eos is not None:
                writer.write([eos])
    return writer.close()


def run(args: argparse.Namespace) -> int:
    """Prepare the token shards; bad input is a UserError (one line, exit 2, `tpkit.cli`)."""
    index = prepare(args.files, args.tokenizer, args.out, args.dtype, args.shard_tokens,
                    not args.no_progress)
    print(f"{index['tokens']:,} tokens ({index['dtype']}, vocab_size={index['vocab_size']}) "
          f"in {len(index['shards'])} shard(s) under {args.out}")
    return 0
