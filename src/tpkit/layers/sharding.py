"""How a tensor-parallel parameter is split, as a tag on the parameter (nanotron style).

Checkpoints, Hugging Face import/export and the tests read the tag instead of
guessing from names. A split is along one `dim`, in logical `parts` (a fused
gate+up weight has two parts, a fused qkv weight three), and each part is cut into
`chunks` pieces: chunks == tp means every rank owns its own piece; chunks < tp means
groups of tp/chunks ranks hold the same piece (grouped-query kv heads when
kv_heads < tp); chunks == 1 means the part is replicated.

    fused [gate; up] weight, tp=2 (rows = dim 0):     rank 0        rank 1
      gate rows 0..f-1   -> chunks of f/2            gate[:f/2]    gate[f/2:]
      up   rows f..2f-1  -> chunks of f/2            up[:f/2]      up[f/2:]

Every fact tpkit keeps about a parameter lives in one `ParamMeta` record on it, read
with `meta_of` and written with `set_meta`; no other module names the attribute.
`TPSplit.pieces(rank, tp)` is the one walk over parts and chunks: sharding,
unsharding, checkpoint reads, gradient sums and norms all use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

_META = "_tpkit_meta"  # the one attribute tpkit sets on a torch.nn.Parameter


@dataclass(frozen=True)
class Piece:
    """One chunk of one logical part, as a rank holds it (offsets along the split dim)."""

    part: int  # which logical part
    chunk: int  # which chunk of that part
    chunks: int  # how many chunks the part is cut into (< tp: shared by tp/chunks ranks)
    part_start: int  # where the part starts in the global tensor
    start: int  # where this chunk starts in the global tensor
    local_start: int  # where it starts in the rank's shard
    size: int  # its length


@dataclass(frozen=True)
class TPSplit:
    """A parameter split along `dim` into logical `parts`, part i cut into `chunks[i]`."""

    dim: int
    parts: tuple[int, ...]
    chunks: tuple[int, ...]

    @classmethod
    def even(cls, dim: int, size: int, tp: int) -> TPSplit:
        """One part, split evenly over tp."""
        return cls(dim, (size,), (tp,))

    def check(self, tp: int, what: str = "parameter") -> None:
        """ValueError naming the numbers unless every part splits as declared."""
        for size, n in zip(self.parts, self.chunks):
            if n < 1 or tp % n:
                raise ValueError(f"{what}: {n} chunks do not divide over tp={tp}")
            if size % n:
                raise ValueError(f"{what}: partition of size {size} does not split evenly "
                                 f"into {n} chunks (tp={tp})")

    def local_size(self) -> int:
        """Size along `dim` that each rank holds."""
        return sum(size // n for size, n in zip(self.parts, self.chunks))

    def chunk_index(self, part: int, rank: int, tp: int) -> int:
        """Which chunk of `part` rank `rank` holds."""
        return rank * self.chunks[part] // tp

    def shared(self, tp: int) -> bool:
        """True when some part is held by several ranks (its gradient needs a sum)."""
        return any(n < tp for n in self.chunks)

    def pieces(self, rank: int, tp: int) -> Iterator[Piece]:
        """What rank `rank` of `tp` holds, part by part, in the order of its shard."""
        part_start = local_start = 0
        for i, (size, n) in enumerate(zip(self.parts, self.chunks)):
            c, j = size // n, self.chunk_index(i, rank, tp)
            yield Piece(i, j, n, part_start, part_start + j * c, local_start, c)
            part_start, local_start = part_start + size, local_start + c

    def owned_pieces(self, tp: int) -> list[tuple[int, Piece]]:
        """Every chunk once, in global order, with the lowest rank that holds it."""
        first: dict[int, tuple[int, Piece]] = {}
        for rank in range(tp):
            for pc in self.pieces(rank, tp):
                first.setdefault(pc.start, (rank, pc))
        return [first[k] for k in sorted(first)]


@dataclass(frozen=True)
class ParamMeta:
    """What tpkit knows about a parameter beyond its local tensor."""

    split: TPSplit | None = None  # None: replicated over tp
    sequence_parallel: bool = False  # replicated, but each tp rank's gradient is partial
    tied_to: str | None = None  # the name of the parameter it is a copy of (on another stage)
    logical_size: int | None = None  # rows along dim 0 past it are vocabulary padding


def meta_of(param: torch.Tensor) -> ParamMeta:
    """The parameter's record (defaults when none was set)."""
    return getattr(param, _META, None) or ParamMeta()


def set_meta(param: torch.Tensor, **changes) -> torch.Tensor:
    """Change fields of the parameter's record (e.g. `split=`, `tied_to=`); returns it."""
    setattr(param, _META, replace(meta_of(param), **changes))
    return param


def shard(full: torch.Tensor, split: TPSplit, rank: int, tp: int) -> torch.Tensor:
    """The slice of a full (global) tensor that `rank` of `tp` holds."""
    if sum(split.parts) != full.shape[split.dim]:
        raise ValueError(f"tensor of size {full.shape[split.dim]} along dim {split.dim} does not "
                         f"match the partitions {list(split.parts)} (sum {sum(split.parts)})")
    pieces = [full.narrow(split.dim, pc.start, pc.size) for pc in split.pieces(rank, tp)]
    return torch.cat(pieces, split.dim) if len(pieces) > 1 else pieces[0].clone()


def unshard(shards: list[torch.Tensor], split: TPSplit) -> torch.Tensor:
    """Rebuild the full tensor from every rank's shard (rank order)."""
    out = [shards[r].narrow(split.dim, pc.local_start, pc.size)
           for r, pc in split.owned_pieces(len(shards))]
    return torch.cat(out, split.dim)


def split_of(param: torch.Tensor) -> TPSplit | None:
    """`meta_of(param).split`: the parameter's split, or None when replicated over tp."""
    return meta_of(param).split


def master_normal(shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The full (tp=1) weight, drawn from `seed` on the CPU: every tp holds these values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


def seed_for(base: int, name: str) -> int:
    """A stable per-parameter seed from a base seed and a module path."""
    import zlib

    return (base * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def full_state_dict(per_rank: list[dict[str, torch.Tensor]], splits: dict[str, TPSplit | None]
                    ) -> dict[str, torch.Tensor]:
    """Rebuild a full state dict from every tp rank's local one (rank order)."""
    out = {}
    for name, split in splits.items():
        tensors = [sd[name] for sd in per_rank]
        out[name] = tensors[0] if split is None or len(tensors) == 1 else unshard(tensors, split)
    return out


def splits_of(module: torch.nn.Module) -> dict[str, TPSplit | None]:
    """name -> split for every parameter of a module."""
    return {name: split_of(p) for name, p in module.named_parameters()}
