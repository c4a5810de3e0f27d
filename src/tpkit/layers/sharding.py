"""How a tensor-parallel parameter is split, as a tag on the parameter (nanotron style).

Checkpoints, Hugging Face import/export and the tests read the tag instead of
guessing from names. The tag is a `tpkit.spec.split.TPSplit`: along one `dim`, in
logical `parts` (a fused gate+up weight has two parts, a fused qkv weight three),
each part dealt over tp in units (heads, columns) as evenly as possible, the first
ranks one unit more; grouped-query kv heads follow the query heads that read them.

    fused [gate; up] weight of ffn f=5, tp=2 (rows = dim 0):  rank 0       rank 1
      gate rows 0..4   -> 3 + 2 rows                          gate[:3]     gate[3:]
      up   rows 5..9   -> 3 + 2 rows                          up[:3]       up[3:]

Every fact tpkit keeps about a parameter lives in one `ParamMeta` record on it, read
with `meta_of` and written with `set_meta`; no other module names the attribute.
`TPSplit.pieces(rank, tp)` is the one walk over what a rank holds: sharding,
unsharding, checkpoint reads, gradient sums and norms all use it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch

from tpkit.spec.split import Piece, TPSplit

__all__ = ["ParamMeta", "Piece", "TPSplit", "full_state_dict", "master_normal", "materialize",
           "meta_of", "seed_for", "set_meta", "shard", "split_of", "splits_of", "unshard"]

_META = "_tpkit_meta"  # the one attribute tpkit sets on a torch.nn.Parameter


@dataclass(frozen=True)
class ParamMeta:
    """What tpkit knows about a parameter beyond its local tensor."""

    split: TPSplit | None = None  # None: replicated over tp
    sequence_parallel: bool = False  # replicated, but each tp rank's gradient is partial
    tied_to: str | None = None  # the name of the parameter it is a copy of (on another stage)
    logical_size: int | None = None  # rows along dim 0 past it are vocabulary padding
    adapter: bool = False  # a LoRA factor (`layers.lora`): trained, the rest frozen


def meta_of(param: torch.Tensor) -> ParamMeta:
    """The parameter's record (defaults when none was set)."""
    return getattr(param, _META, None) or ParamMeta()


def set_meta(param: torch.Tensor, **changes) -> torch.Tensor:
    """Change fields of the parameter's record (e.g. `split=`, `tied_to=`); returns it."""
    setattr(param, _META, replace(meta_of(param), **changes))
    return param


def materialize(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Allocate a meta-built module on `device`, keeping its parameters' records."""
    tags = {n: dict(vars(p)) for n, p in module.named_parameters()}
    module.to_empty(device=device)
    for n, p in module.named_parameters():
        vars(p).update(tags[n])
    return module


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
