"""Reading this rank's slice of global tensors from anywhere: the one loop.

A `Source` serves rows [start, stop) of a *logical* global tensor (vocabulary
padding excluded) along one dimension: a sharded tpkit checkpoint
(`tpkit.weights.files.ShardedSource`), one full safetensors file, a dict in memory,
or a Hugging Face model (`tpkit.weights.hf.HFSource`). An open source also says
what it holds: `config` (its ModelConfig), `names` (its tensors), `where` (for errors).

    staged = read_local(model, source, mesh)   # name -> this rank's slice, every parameter

`read_local` is how every caller reads weights (Hugging Face import, sharded load,
convert, optimizer state): per parameter, `local_slice` reads, part by part, exactly
the chunk that a rank of the model's layout holds, driven by the parameter's split
tag, so no process reads a whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from tpkit.layers.sharding import TPSplit, meta_of, split_of
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import CheckpointError


# -- reading slices ---------------------------------------------------------------------
class Source(Protocol):
    """Where global tensors come from (sharded checkpoint, full file, Hugging Face)."""

    config: ModelConfig  # the model its tensors make
    names: set[str]  # the tensors it holds (tpkit names)
    where: str  # what to name in an error (the file or folder)

    def logical_shape(self, name: str) -> tuple[int, ...] | None:
        """Global shape without vocabulary padding; None when the source lacks `name`."""

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the logical global tensor along `dim`."""


class DictSource:
    """A `Source` over a dict of full logical tensors (in memory)."""

    def __init__(self, full: dict[str, torch.Tensor], config: ModelConfig | None = None,
                 where: str = "tensors") -> None:
        self.full, self.config, self.names, self.where = full, config, set(full), where

    def logical_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of `name` (None: absent)."""
        return tuple(self.full[name].shape) if name in self.full else None

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along `dim`."""
        t = self.full[name]
        return t if t.dim() == 0 else t.narrow(dim, start, stop - start)


class FullSource:
    """One safetensors file of full (logical, unpadded) tensors, e.g. `tpkit convert`'s."""

    def __init__(self, path: str | Path, config: ModelConfig | None = None) -> None:
        self.path, self.config, self.where = Path(path), config, str(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file")
        self.f = self._open()
        self.names = set(self.f.keys())

    def _open(self):
        return open_safetensors(self.path)

    def __getstate__(self) -> dict:  # picklable (to the ranks): the file is opened again
        return {k: v for k, v in vars(self).items() if k != "f"}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self.f = self._open()

    def logical_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape in the file (None: absent)."""
        return tuple(self.f.get_slice(name).get_shape()) if name in self.names else None

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along `dim`."""
        sl = self.f.get_slice(name)
        if not sl.get_shape():
            return self.f.get_tensor(name)
        return sl[(slice(None),) * dim + (slice(start, stop),)]


def open_safetensors(path: Path):
    """`safe_open` of a file, or one CheckpointError naming it (truncated, or not a
    safetensors file at all)."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors' own error type varies
        raise CheckpointError(f"{path}: not a readable safetensors file "
                              f"({str(e).splitlines()[0][:120]})") from None


def read_local(model: nn.Module, source: Source, mesh, *, own_only: bool = False,
               state_keys: dict[str, list[str]] | None = None) -> dict[str, torch.Tensor]:
    """This rank's slice (at `mesh`'s tp rank and size) of every parameter of `model`,
    read from `source` by the parameter's split tag: name -> tensor in its dtype. A tied
    copy reads its owner's tensor; `own_only` leaves tied copies out. LoRA adapters the
    source lacks (a base model's weights) are left out: they keep their initial values.

    With `state_keys` (parameter -> keys of its saved optimizer state) it reads the
    state instead: "{param}::{key}" -> tensor, split like the parameter (a scalar whole).
    """
    out = {}
    for name, p in model.named_parameters():
        owner = meta_of(p).tied_to
        if owner and own_only or state_keys is None and meta_of(p).adapter \
                and name not in source.names:
            continue
        src = owner or name
        rows = meta_of(p).logical_size  # the vocabulary: rows past it are padding
        if state_keys is None:
            out[name] = local_slice(source, src, split_of(p), mesh.tp_rank, mesh.tp_size,
                                    tuple(p.shape), source.where, rows).to(p.dtype)
            continue
        for key in state_keys.get(src, []):
            full = state_name(src, key)
            scalar = source.logical_shape(full) == ()
            out[state_name(name, key)] = local_slice(
                source, full, None if scalar else split_of(p), mesh.tp_rank, mesh.tp_size,
                () if scalar else tuple(p.shape), source.where, rows)
    return out


def state_name(param: str, key: str) -> str:
    """The name on disk of one entry of a parameter's optimizer state: "{param}::{key}"."""
    return f"{param}::{key}"


def local_slice(source: Source, name: str, split: TPSplit | None, rank: int, tp: int,
                shape: tuple[int, ...], where: str = "checkpoint", rows: int | None = None
                ) -> torch.Tensor:
    """What `rank` of `tp` holds of global tensor `name`: its chunk of every part, each
    read from `source`; rows past `rows` (the vocabulary; padding) are zeros. A tensor
    the source lacks, or of another shape, is one CheckpointError naming it as the
    source does (a Hugging Face file: its own tensor names and shapes)."""
    logical = source.logical_shape(name)
    if logical is None:
        missing = getattr(source, "missing", None)
        said = missing(name) if missing else f"has no tensor {name!r}"
        raise CheckpointError(f"{where}: {said}")
    full = list(shape)
    if split is not None:
        full[split.dim] = sum(split.parts)
    want = list(full)
    if rows is not None and want:
        want[0] = rows
    problem = getattr(source, "shape_problem", None)
    if problem is not None and (said := problem(name, tuple(want))):
        raise CheckpointError(f"{where}: {said}")
    _check_dims(logical, tuple(full), split, name, where, rows)
    if split is None:
        if not shape:
            return source.read(name, 0, 0, 1).reshape(())
        return source.read(name, 0, 0, shape[0])
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
                name: str, where: str, rows: int | None = None) -> None:
    """The source's shape is the model's, but for vocabulary padding (`rows` of dim 0)."""
    ok = len(logical) == len(full)
    for d, (a, b) in enumerate(zip(logical, full)):
        padded = rows is not None and d == 0 and split is not None and split.dim == 0
        ok = ok and (a == rows if padded else a == b)
    if not ok:
        want = [rows, *full[1:]] if rows is not None else list(full)
        raise CheckpointError(f"{where}: tensor {name!r} has global shape {list(logical)}, "
                              f"the model expects {want}")
