"""Token files: shards of uint16 / uint32 ids plus a small JSON index, read memory-mapped.

    tokens/
      index.json          {"format": "tpkit-tokens", "dtype": "uint32", "vocab_size": 128256,
                           "shards": [{"file": "shard_00000.bin", "tokens": 16777216}, ...]}
      shard_00000.bin     raw little-endian ids, back to back
      shard_00001.bin
      mask_00000.bin      chat data only: one uint8 per token, 1 for the assistant's
                          (`chat_mask`; index: "assistant_mask": true, each shard's "mask")

Written by `tpkit prepare-data` (`ShardWriter`), read by the trainer with
`open_shards`: each shard is an `np.memmap`, and `TokenStream` serves slices of the
concatenation without ever loading it, so a corpus larger than memory trains.
uint16 when the vocabulary fits (ids < 65536), else uint32.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tpkit.spec.errors import UserError

INDEX, FORMAT = "index.json", "tpkit-tokens"
MASK_KEY = "assistant_mask"  # in the index: true when every chat's mask was found
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dtype_for(vocab_size: int, dtype: str = "auto") -> str:
    """The token dtype for a vocabulary: uint16 when it fits, else uint32; a forced dtype
    that is too small for the vocabulary is a ValueError naming both."""
    if dtype == "auto":
        dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    if dtype not in DTYPES:
        raise UserError(f"token dtype {dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
    top = int(np.iinfo(DTYPES[dtype]).max)
    if vocab_size - 1 > top:
        raise UserError(f"vocab_size={vocab_size} does not fit {dtype} (ids up to {top})"
                         + ("; use uint32" if dtype == "uint16" else ""))
    return dtype


class TokenStream:
    """Several 1-d id arrays (memory maps, views) read as one, without concatenating."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])  # [n_parts + 1]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("a TokenStream slices with step 1 only")
            return self._range(start, stop)
        i = key + len(self) if key < 0 else key
        if not 0 <= i < len(self):
            raise IndexError(f"token {key} of {len(self)}")
        return self._range(i, i + 1)[0]

    def _range(self, start: int, stop: int) -> np.ndarray:
        """ids [start, stop) (a view when inside one part)."""
        pieces = []
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for j in range(max(first, 0), len(self.parts)):
            lo, hi = max(start, self.starts[j]), min(stop, self.starts[j + 1])
            if lo >= hi:
                break
            pieces.append(self.parts[j][lo - self.starts[j]:hi - self.starts[j]])
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.uint16)

    def __iter__(self) -> Iterator[int]:
        for p in self.parts:
            yield from (int(t) for t in p)

    def max(self) -> int:
        """The largest id (reads every part once)."""
        return max(int(p.max()) for p in self.parts)


class ShardWriter:
    """Append ids; a new shard every `shard_tokens`; `close()` writes the index last, so
    a folder with an index.json is complete (files are written under temporary names).
    Used as a context, an error closes the shard file open (a full disk: nothing held)."""

    def __init__(self, out: str | Path, vocab_size: int, dtype: str = "auto",
                 shard_tokens: int = 1 << 26, meta: dict | None = None,
                 masked: bool = False) -> None:
        self.out, self.vocab_size = Path(out), vocab_size
        self.dtype = dtype_for(vocab_size, dtype)
        self.shard_tokens, self.meta = shard_tokens, dict(meta or {})
        self.out.mkdir(parents=True, exist_ok=True)
        self.shards: list[dict] = []
        self.max_id, self._file, self._n, self.masked = -1, None, 0, masked
        self._mask = None  # the mask file of the shard being written (masked)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind, error, tb) -> None:
        """On an error, close the shard being written (its temporary is the caller's to
        remove: `data_folder.replacing` removes the whole folder)."""
        if kind is not None and self._file is not None:
            self._file.close()
            self._file = None
        if kind is not None and self._mask is not None:
            self._mask.close()
            self._mask = None

    def write(self, ids: list[int] | np.ndarray, mask: list[int] | None = None) -> None:
        """Append token ids (checked against the vocabulary), and with `masked` their mask
        (one 0/1 per id)."""
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.asarray(mask, dtype=np.uint8) if self.masked else None
        if ids.size and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
            raise UserError(f"token id {bad} is outside the tokenizer's vocab_size="
                             f"{self.vocab_size}")
        self.max_id = max(self.max_id, int(ids.max()) if ids.size else -1)
        while ids.size:
            if self._file is None or self._n == self.shard_tokens:
                self._roll()
            take = ids[:self.shard_tokens - self._n]
            self._file.write(take.astype(DTYPES[self.dtype]).data)  # a full disk: its errno
            if mask is not None:
                self._mask.write(mask[:take.size].data)
                mask = mask[take.size:]
            self._n, ids = self._n + take.size, ids[take.size:]

    def _roll(self) -> None:
        self._finish_shard()
        i = len(self.shards)
        name = f"shard_{i:05d}.bin"
        self.shards.append(dict(file=name, tokens=0))
        self._file, self._n = open(self.out / f".{name}.tmp", "wb"), 0
        if self.masked:
            self.shards[-1]["mask"] = f"mask_{i:05d}.bin"
            self._mask = open(self.out / f".mask_{i:05d}.bin.tmp", "wb")

    def _finish_shard(self) -> None:
        if self._file is not None:
            self._file.close()
            name = self.shards[-1]["file"]
            (self.out / f".{name}.tmp").replace(self.out / name)
            self.shards[-1]["tokens"] = self._n
            self._file = None
        if self._mask is not None:
            self._mask.close()
            name = self.shards[-1]["mask"]
            (self.out / f".{name}.tmp").replace(self.out / name)
            self._mask = None

    def close(self) -> dict:
        """Finish the last shard and write index.json; returns the index."""
        self._finish_shard()
        total = sum(s["tokens"] for s in self.shards)
        index = dict(format=FORMAT, version=1, dtype=self.dtype, vocab_size=self.vocab_size,
                     max_id=self.max_id, tokens=total, shards=self.shards, **self.meta)
        tmp = self.out / f".{INDEX}.tmp"
        tmp.write_text(json.dumps(index, indent=1))
        tmp.replace(self.out / INDEX)
        return index


def read_index(folder: Path) -> dict:
    """The index.json of a `prepare-data` folder, validated: one UserError line listing
    every problem (not JSON, a missing key, a wrong type, shard counts that disagree)."""
    path = folder / INDEX
    try:
        index = json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    problems = index_problems(index)
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems))
    return index


def index_problems(index) -> list[str]:
    """Every reason `index` is not a tpkit token index; empty when it is one."""
    if not isinstance(index, dict):
        return [f"not a tpkit token index (a JSON {type(index).__name__}, not an object)"]
    if index.get("format") != FORMAT:
        return [f"not a tpkit token index (format {index.get('format')!r}, not {FORMAT!r})"]
    out = [] if index.get("dtype") in DTYPES else \
        [f"dtype {index.get('dtype')!r} is not one of {sorted(DTYPES)}"]
    for key, low in (("vocab_size", 1), ("max_id", -1)):
        if not _int_at_least(index.get(key), low):
            out.append(f"{key} {index.get(key)!r} is not an integer >= {low}"
                       if key in index else f"{key} is missing")
    shards = index.get("shards")
    if not isinstance(shards, list):
        return out + [f"shards {shards!r} is not a list" if "shards" in index
                      else "shards is missing"]
    for i, shard in enumerate(shards):
        if not (isinstance(shard, dict) and isinstance(shard.get("file"), str)
                and _int_at_least(shard.get("tokens"), 0)):
            out.append(f"shards[{i}] = {shard!r} is not {{\"file\": NAME, \"tokens\": N >= 0}}")
    total = index.get("tokens")
    if not out and total is not None and total != sum(s["tokens"] for s in shards):
        out.append(f"tokens={total!r}, but the shards hold {sum(s['tokens'] for s in shards)}")
    return out


def _int_at_least(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def open_masks(folder: str | Path, index: dict) -> TokenStream | None:
    """The assistant masks of a chat folder's shards, memory-mapped (None: no mask);
    one UserError line for a mask file that is missing or of the wrong size."""
    if not index.get(MASK_KEY):
        return None
    parts = []
    for shard in index["shards"]:
        path = Path(folder) / str(shard.get("mask"))
        if not path.is_file() or path.stat().st_size != shard["tokens"]:
            have = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
            raise UserError(f"{path}: {have}, the index says {shard['tokens']} tokens (one "
                            f"mask byte each); prepare the data again")
        if shard["tokens"]:
            parts.append(np.memmap(path, dtype=np.uint8, mode="r"))
    return TokenStream(parts)


def open_shards(folder: str | Path) -> tuple[TokenStream, dict]:
    """(memory-mapped ids, index) of a `prepare-data` folder; clear errors on damage."""
    folder = Path(folder)
    index = read_index(folder)
    listed = {s["file"] for s in index["shards"]}
    stray = sorted(p.name for p in folder.glob("*shard_*.bin*") if p.name not in listed)
    stray += sorted(p.name for p in folder.glob("*mask_*.bin*")
                    if p.name not in {s.get("mask") for s in index["shards"]})
    if stray:  # a run that wrote into the folder after (or during) the one indexed
        raise UserError(f"{folder}: {', '.join(stray[:4])} not in {INDEX} (it lists "
                        f"{len(listed)} shard(s)): the shards are not the ones indexed; "
                        f"prepare the data again")
    dtype = DTYPES[index["dtype"]]
    parts = []
    for shard in index["shards"]:
        path = folder / shard["file"]
        want = shard["tokens"] * np.dtype(dtype).itemsize
        if not path.is_file() or path.stat().st_size != want:
            have = path.stat().st_size if path.is_file() else "missing"
            raise UserError(f"{path}: {have} bytes, the index says {shard['tokens']} "
                             f"{index['dtype']} tokens = {want} bytes")
        if shard["tokens"]:
            parts.append(np.memmap(path, dtype=dtype, mode="r"))
    return TokenStream(parts), index
