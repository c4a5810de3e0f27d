"""Where the text of `tpkit prepare-data` comes from: the files people have.

    corpus.txt            one document per file (read a block of lines at a time)
    chats.jsonl           one JSON object per line: its "text" field (--text-field), or
                          its messages (--chat-field) rendered by the tokenizer's chat template
    shard.parquet         a column of strings (or of messages), read a batch of rows at a time
    saved/                a Hugging Face `datasets` folder (`Dataset.save_to_disk`; of a
                          DatasetDict, its train split)

`open_sources` names each path's kind once, and checks the field, before anything is
tokenized; `documents` yields (text, bytes read, end of a document). A path that is
none of these, a missing field, text that is not UTF-8 (the offset of its first bad
byte), a Parquet file or datasets folder its library cannot read, or a source with no
usable text is one UserError.
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
    choose: str = "choose one with --text-field or --chat-field"  # said of a missing field

    @property
    def name(self) -> str:
        """The field read."""
        return self.chat or self.text


def documents_kind(path: Path) -> str | None:
    """DATASETS, JSONL or PARQUET: a path read as documents of a field; None otherwise."""
    if path.is_dir():
        datasets = (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
        return DATASETS if datasets else None
    return _SUFFIXES.get(path.suffix.lower())


def kind_of(path: Path) -> str:
    """A path's kind: a `datasets` folder, .jsonl, .parquet, else plain UTF-8 text."""
    if path.is_dir():
        if documents_kind(path) == DATASETS:
            return DATASETS
        raise UserError(f"{path} is a directory but not a `datasets` save_to_disk folder "
                        f"(no dataset_info.json); give its text files instead")
    if not path.is_file():
        raise FileNotFoundError(f"input {path} does not exist")
    return documents_kind(path) or TEXT


def open_sources(paths: list[str], fields: Fields) -> list[Source]:
    """Every input with its kind and size, its field checked where columns are known."""
    sources = []
    for p in map(Path, paths):
        kind = kind_of(p)
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() \
            else p.stat().st_size
        if kind in (PARQUET, DATASETS):
            _check_columns(p, _columns(p, kind), fields.name, fields.choose)
        else:
            check_text(p)
        sources.append(Source(p, kind, size))
    return sources


def check_text(path: Path, sample: int = BLOCK_BYTES, tolerated: float = 0.01) -> None:
    """A UserError when `path` is not UTF-8 text: NUL bytes in more than `tolerated` of its
    first `sample` bytes (a binary, an archive, a UTF-16 file), or a byte there that is not
    UTF-8 (`utf8`; the rest of the file is checked as it is read)."""
    with open(path, "rb") as f:
        data = f.read(sample)
    nul = data.count(b"\0")
    if data and nul > tolerated * len(data):  # (NUL is valid UTF-8)
        raise UserError(f"{path}: not a text file ({nul:,} NUL bytes in its first "
                        f"{len(data):,} bytes); tpkit reads UTF-8 text, .jsonl, .parquet "
                        f"or a datasets folder")
    utf8(data, path, 0, ends=len(data) < sample)  # (a full sample may end in a character)


def utf8(data: bytes, path: Path, offset: int, ends: bool = True) -> str:
    """`data` (bytes `offset`.. of `path`) decoded; a UserError naming the byte offset of
    the first byte that is not UTF-8 (`ends`: False when `data` may stop inside a
    character, whose start is then not an error)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if not ends and e.reason == "unexpected end of data":
            return data[:e.start].decode("utf-8")
        at = offset + e.start
        raise UserError(f"{path}: not UTF-8 text: byte 0x{data[e.start]:02x} at byte offset "
                        f"{at} ({e.reason}); convert the file to UTF-8 (iconv -f ENCODING "
                        f"-t UTF-8)") from None


def read_text(path: Path) -> str:
    """The whole text of a UTF-8 file, checked as `prepare-data` reads it (`documents`)."""
    check_text(path)
    return "".join(text for text, _, _ in _text_pieces(path))


def _check_columns(path: Path, columns: list[str], field: str, choose: str) -> None:
    if field not in columns:
        raise UserError(f"{path}: no column {field!r} (columns: {columns}); {choose}")


def _columns(path: Path, kind: str) -> list[str]:
    if kind == PARQUET:
        return list(_parquet(path).schema_arrow.names)
    return list(_dataset(path).column_names)


def _parquet(path: Path):
    """The open ParquetFile; one line naming the file when pyarrow cannot read it."""
    # lazy: optional (tpkit[data])
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0]


def _dataset(path: Path):
    """A save_to_disk folder: the Dataset (of a DatasetDict, its train split)."""
    # lazy: optional (tpkit[data])
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a readable `datasets` folder ({_one_line(e)})") from None
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
    """Blocks of about BLOCK_BYTES cut after a newline (never inside a UTF-8 character);
    the file is one document."""
    with open(path, "rb") as f:
        offset, data = 0, f.read(BLOCK_BYTES)
        while data:
            data += f.readline()  # finish the line: no cut inside a word
            after = f.read(BLOCK_BYTES)
            yield utf8(data, path, offset), len(data), not after
            offset, data = offset + len(data), after


def _jsonl_pieces(path: Path, fields: Fields) -> Iterator[Piece]:
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line, offset = utf8(raw, path, offset), offset + len(raw)
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
                                f"{sorted(row)}); {fields.choose}")
            yield _text_of(row[fields.name], fields, f"{path} line {n}"), len(raw), True


def _row_pieces(src: Source, fields: Fields) -> Iterator[Piece]:
    """Rows of a .parquet file or a datasets folder, ROWS at a time."""
    if src.kind == PARQUET:
        file = _parquet(src.path)
        total = file.metadata.num_rows
        batches = _parquet_batches(file, src.path, fields.name)
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


def _parquet_batches(file, path: Path, column: str) -> Iterator[list]:
    """The values of `column`, ROWS at a time; a damaged row group is one line."""
    # lazy: optional (tpkit[data])
    import pyarrow as pa

    batches = file.iter_batches(batch_size=ROWS, columns=[column])
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None
        if batch is None:
            return
        yield batch.column(0).to_pylist()


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
