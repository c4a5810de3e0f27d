"""Where the text of `tpkit prepare-data` comes from: the files people have.

    corpus.txt            one document per file (read a block of lines at a time)
    chats.jsonl           one JSON object per line: its "text" field (--text-field), or
                          its messages (--chat-field) rendered by the tokenizer's chat template
    shard.parquet         a column of strings (or of messages), read a batch of rows at a time
    saved/                a Hugging Face `datasets` folder (`Dataset.save_to_disk`; of a
                          DatasetDict, its train split)

`open_sources` names each path's kind once, and checks the field, before anything is
tokenized; `documents` yields (text, bytes read, end of a document). A path that is
none of these, a missing field, or a source with no usable text is one UserError.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tpkit.spec.errors import UserError

BLOCK_BYTES = 1 << 20  # text of a .txt file read per piece (cut at line ends)
ROWS = 1024  # rows of a .parquet file or a datasets folder read per batch
JSONL, PARQUET, DATASETS, TEXT = "jsonl", "parquet", "datasets", "text"
_SUFFIXES = {".jsonl": JSONL, ".ndjson": JSONL, ".parquet": PARQUET}
Piece = tuple[str, int, bool]  # text, bytes of the source it covers, ends a document


@dataclass(frozen=True)
class Source:
    """One input: its path, kind (text, jsonl, parquet, datasets) and size on disk."""

    path: Path
    kind: str
    size: int


@dataclass(frozen=True)
class Fields:
    """Which field holds a document: `text`, or `chat` (a list of messages) rendered
    by `render` (the tokenizer's chat template)."""

    text: str = "text"
    chat: str | None = None
    render: Callable[[list], str] | None = None

    @property
    def name(self) -> str:
        """The field read."""
        return self.chat or self.text


def kind_of(path: Path) -> str:
    """A path's kind: a `datasets` folder, .jsonl, .parquet, else plain UTF-8 text."""
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return DATASETS
        raise UserError(f"{path} is a directory but not a `datasets` save_to_disk folder "
                        f"(no dataset_info.json); give its text files instead")
    if not path.is_file():
        raise FileNotFoundError(f"input {path} does not exist")
    return _SUFFIXES.get(path.suffix.lower(), TEXT)


def open_sources(paths: list[str], fields: Fields) -> list[Source]:
    """Every input with its kind and size, its field checked where columns are known."""
    sources = []
    for p in map(Path, paths):
        kind = kind_of(p)
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() \
            else p.stat().st_size
        if kind in (PARQUET, DATASETS):
            _check_columns(p, _columns(p, kind), fields.name)
        else:
            check_text(p)
        sources.append(Source(p, kind, size))
    return sources


def check_text(path: Path, sample: int = BLOCK_BYTES, tolerated: float = 0.01) -> None:
    """A UserError when `path` is not UTF-8 text: NUL bytes or invalid UTF-8 in more than
    `tolerated` of its first `sample` bytes (a binary, an archive, a UTF-16 file)."""
    with open(path, "rb") as f:
        data = f.read(sample)
    nul = data.count(b"\0")
    invalid = len(data) - len(data.decode("utf-8", errors="ignore").encode("utf-8"))
    if data and (nul + invalid) > tolerated * len(data):  # (NUL is valid UTF-8: apart)
        raise UserError(f"{path}: not a text file ({nul:,} NUL bytes and {invalid:,} bytes of "
                        f"invalid UTF-8 in its first {len(data):,} bytes); prepare-data reads "
                        f"UTF-8 text, .jsonl, .parquet or a datasets folder")


def _check_columns(path: Path, columns: list[str], field: str) -> None:
    if field not in columns:
        raise UserError(f"{path}: no column {field!r} (columns: {columns}); choose one with "
                        f"--text-field or --chat-field")


def _columns(path: Path, kind: str) -> list[str]:
    if kind == PARQUET:
        import pyarrow.parquet as pq

        return list(pq.ParquetFile(path).schema_arrow.names)
    return list(_dataset(path).column_names)


def _dataset(path: Path):
    """A save_to_disk folder: the Dataset (of a DatasetDict, its train split)."""
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(str(path))
    if isinstance(ds, DatasetDict):
        if "train" not in ds:
            raise UserError(f"{path}: a DatasetDict without a train split (splits: "
                            f"{list(ds)}); save the split to prepare on its own")
        ds = ds["train"]
    return ds


def documents(src: Source, fields: Fields) -> Iterator[Piece]:
    """The pieces of text of one source, in order."""
    if src.kind == TEXT:
        yield from _text_pieces(src.path)
    elif src.kind == JSONL:
        yield from _jsonl_pieces(src.path, fields)
    else:
        yield from _row_pieces(src, fields)


def _text_pieces(path: Path) -> Iterator[Piece]:
    """Blocks of about BLOCK_BYTES cut after a newline; the file is one document."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read(BLOCK_BYTES)
        while text:
            text += f.readline()  # finish the line: no cut inside a word
            after = f.read(BLOCK_BYTES)
            yield text, len(text.encode("utf-8")), not after
            text = after


def _jsonl_pieces(path: Path, fields: Fields) -> Iterator[Piece]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path} line {n}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path} line {n}: a JSON {type(row).__name__}, not an object")
            if fields.name not in row:
                raise UserError(f"{path} line {n}: no field {fields.name!r} (fields: "
                                f"{sorted(row)}); choose one with --text-field or --chat-field")
            yield _text_of(row[fields.name], fields, f"{path} line {n}"), len(line.encode()), True


def _row_pieces(src: Source, fields: Fields) -> Iterator[Piece]:
    """Rows of a .parquet file or a datasets folder, ROWS at a time."""
    if src.kind == PARQUET:
        import pyarrow.parquet as pq

        file = pq.ParquetFile(src.path)
        total = file.metadata.num_rows
        batches = (b.column(0).to_pylist()
                   for b in file.iter_batches(batch_size=ROWS, columns=[fields.name]))
    else:
        ds = _dataset(src.path)
        total = len(ds)
        batches = (ds[i:i + ROWS][fields.name] for i in range(0, total, ROWS))
    row, total = 0, max(total, 1)
    for values in batches:
        for v in values:  # the bytes on disk shared out over the rows
            size = src.size * (row + 1) // total - src.size * row // total
            yield _text_of(v, fields, f"{src.path} row {row}"), size, True
            row += 1


def _text_of(value, fields: Fields, where: str) -> str:
    """A field's document: a string, or messages rendered by the chat template."""
    if fields.chat is not None:
        if not isinstance(value, list):
            raise UserError(f"{where}: {fields.chat!r} is a {type(value).__name__}, not a "
                            f"list of messages")
        return fields.render(value)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"{where}: {fields.text!r} is a {type(value).__name__}, not text "
                        f"(for messages use --chat-field)")
    return value
