"""Reading this rank's slice of global tensors from anywhere (Layer: below `model`).

A `Source` serves rows [start, stop) of a *logical* global tensor (vocabulary
padding excluded) along one dimension: a sharded tpkit checkpoint
(`tpkit.checkpoint.files.ShardedSource`), one full safetensors file, a dict in memory,
or a Hugging Face model (`tpkit.model.hf.HFSource`). `local_slice` reads, part by
part, exactly the chunk that a rank of a given layout holds, driven by the
parameter's split tag, so no process reads a whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from tpkit.sharding import TPSplit
from tpkit.spec.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, damaged, or does not fit the model; names the file.

    `peer_failed=True`: this rank is fine, another rank failed (its error is the one
    to show)."""

    def __init__(self, message: str, *, peer_failed: bool = False) -> None:
        super().__init__(message)
        self.peer_failed = peer_failed

    def __reduce__(self):
        return (_checkpoint_error, (str(self), self.peer_failed))


def _checkpoint_error(message: str, peer_failed: bool) -> CheckpointError:
    return CheckpointError(message, peer_failed=peer_failed)


# -- reading slices ---------------------------------------------------------------------
class Source(Protocol):
    """Where global tensors come from (sharded checkpoint, full file, Hugging Face)."""

    def logical_shape(self, name: str) -> tuple[int, ...] | None:
        """Global shape without vocabulary padding; None when the source lacks `name`."""

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the logical global tensor along `dim`."""


class DictSource:
    """A `Source` over a dict of full logical tensors (in memory)."""

    def __init__(self, full: dict[str, torch.Tensor]) -> None:
        self.full = full

    def logical_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of `name` (None: absent)."""
        return tuple(self.full[name].shape) if name in self.full else None

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along `dim`."""
        t = self.full[name]
        return t if t.dim() == 0 else t.narrow(dim, start, stop - start)


class FullSource:
    """One safetensors file of full (logical, unpadded) tensors, e.g. `tpkit convert`'s."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file")
        try:
            self.f = safe_open(str(self.path), framework="pt")
        except Exception as e:  # noqa: BLE001 - safetensors' own error type varies
            raise CheckpointError(f"{self.path}: not a readable safetensors file "
                                  f"({str(e).splitlines()[0][:120]})") from None
        self.names = set(self.f.keys())

    def logical_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape in the file (None: absent)."""
        return tuple(self.f.get_slice(name).get_shape()) if name in self.names else None

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along `dim`."""
        sl = self.f.get_slice(name)
        if not sl.get_shape():
            return self.f.get_tensor(name)
        return sl[(slice(None),) * dim + (slice(start, stop),)]


def local_slice(source: Source, name: str, split: TPSplit | None, rank: int, tp: int,
                shape: tuple[int, ...], where: str = "checkpoint") -> torch.Tensor:
    """What `rank` of `tp` holds of global tensor `name`: its chunk of every part, each
    read from `source`; rows past the logical size (vocabulary padding) are zeros."""
    logical = source.logical_shape(name)
    if logical is None:
        raise CheckpointError(f"{where}: has no tensor {name!r}")
    if split is None:
        _check_dims(logical, shape, None, name, where)
        if not shape:
            return source.read(name, 0, 0, 1).reshape(())
        return source.read(name, 0, 0, shape[0])
    full = list(shape)
    full[split.dim] = sum(split.parts)
    _check_dims(logical, tuple(full), split, name, where)
    pieces = [_padded_read(source, name, split.dim, pc.start, pc.start + pc.size,
                           logical[split.dim]) for pc in split.pieces(rank, tp)]
    return torch.cat(pieces, split.dim) if len(pieces) > 1 else pieces[0]


def _padded_read(source: Source, name: str, dim: int, a: int, b: int, rows: int
                 ) -> torch.Tensor:
    if b <= rows:
        return source.read(name, dim, a, b)
    real = source.read(name, dim, a, rows) if a < rows else None
    shape = list(real.shape if real is not None else source.read(name, dim, 0, 1).shape)
    shape[dim] = b - max(a, rows)
    pad = torch.zeros(shape, dtype=real.dtype if real is not None else torch.float32)
    return pad if real is None else torch.cat([real, pad], dim)


def _check_dims(logical: tuple[int, ...], full: tuple[int, ...], split: TPSplit | None,
                name: str, where: str) -> None:
    ok = len(logical) == len(full)
    for d, (a, b) in enumerate(zip(logical, full)):
        padded = split is not None and d == split.dim and len(split.parts) == 1
        ok = ok and (a <= b if padded else a == b)
    if not ok:
        raise CheckpointError(f"{where}: tensor {name!r} has global shape {list(logical)}, "
                              f"the model expects {list(full)}")
