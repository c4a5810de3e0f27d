"""All-gather and reduce-scatter over a dimension that the ranks hold in unequal parts.

Sequence parallelism cuts the sequence by `spec.shapes.even_range`, which need not be
even: s=7 at tp=2 is 4 + 3. gloo's all-gather and reduce-scatter (and the shared-memory
ones) move equal parts, so every part is padded with zero rows to the largest one,
sent as an even collective, and trimmed:

    all-gather:      [b, 3, h] -> pad to [b, 4, h] -> all-gather [b, 8, h] -> the 7 rows
    reduce-scatter:  [b, 7, h] -> parts 4 | 3 -> pad each to 4 -> [b, 8, h]
                     -> reduce-scatter [b, 4, h] -> this rank's 4 (or 3) rows

The ledger records the padded collective, the bytes that really cross the wire:
tp * ceil(s/tp) rows instead of s (`spec.shapes.sp_padded_seq`, which the theory uses).
When every part has the same size nothing is padded: the plain collective runs.
"""

from __future__ import annotations

import torch

from tpkit.comm import collectives as C
from tpkit.comm.group import CommGroup


def _padded(x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """`x` with zero rows appended along `dim` up to `rows`."""
    short = rows - x.shape[dim]
    if short == 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x, x.new_zeros(shape)], dim)


def _check(sizes: list[int], group: CommGroup) -> None:
    if len(sizes) != group.size:
        raise ValueError(f"{len(sizes)} part sizes for {group.name}={group.size} ranks")


def all_gather_parts(x: torch.Tensor, group: CommGroup, sizes: list[int], dim: int, *,
                     phase: str = "forward", scope: str | None = None) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order), rank r holding `sizes[r]`
    rows of it (this rank's `x` must hold `sizes[group.rank]`)."""
    _check(sizes, group)
    dim = dim % x.dim()
    if x.shape[dim] != sizes[group.rank]:
        raise ValueError(f"all_gather_parts: this rank holds {x.shape[dim]} rows of dimension "
                         f"{dim}, its part is {sizes[group.rank]} of {sizes}")
    m = max(sizes)
    if min(sizes) == m:
        return C.all_gather(x, group, dim, phase=phase, scope=scope)
    full = C.all_gather(_padded(x, dim, m), group, dim, phase=phase, scope=scope)  # p m rows
    return torch.cat([full.narrow(dim, r * m, n) for r, n in enumerate(sizes)], dim)


def _pad_parts(x: torch.Tensor, group: CommGroup, sizes: list[int], dim: int) -> torch.Tensor:
    _check(sizes, group)
    if x.shape[dim] != sum(sizes):
        raise ValueError(f"reduce_scatter_parts: dimension {dim} has {x.shape[dim]} rows, "
                         f"the parts {sizes} add up to {sum(sizes)}")
    m = max(sizes)
    return torch.cat([_padded(part, dim, m) for part in x.split(sizes, dim)], dim)


def reduce_scatter_parts(x: torch.Tensor, group: CommGroup, sizes: list[int], dim: int, *,
                         phase: str = "forward", scope: str | None = None) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's part of `dim`: rows
    sum(sizes[:r]) .. + sizes[r] on rank r."""
    dim = dim % x.dim()
    if min(sizes) == max(sizes):
        return C.reduce_scatter(x, group, dim, phase=phase, scope=scope)
    out = C.reduce_scatter(_pad_parts(x, group, sizes, dim), group, dim, phase=phase,
                           scope=scope)
    return out.narrow(dim, 0, sizes[group.rank])


class _Trimmed:
    """A pending padded reduce-scatter: `wait()` returns this rank's rows only."""

    def __init__(self, pending: C.Pending, dim: int, rows: int) -> None:
        self.pending, self.dim, self.rows = pending, dim, rows

    def wait(self) -> torch.Tensor:
        """Block until done; this rank's part."""
        return self.pending.wait().narrow(self.dim, 0, self.rows)


def reduce_scatter_parts_async(x: torch.Tensor, group: CommGroup, sizes: list[int], dim: int,
                               *, phase: str = "backward", scope: str | None = None):
    """`reduce_scatter_parts` started now; `.wait()` returns this rank's part."""
    dim = dim % x.dim()
    if min(sizes) == max(sizes):
        return C.reduce_scatter_async(x, group, dim, phase=phase, scope=scope)
    pending = C.reduce_scatter_async(_pad_parts(x, group, sizes, dim), group, dim,
                                     phase=phase, scope=scope)
    return _Trimmed(pending, dim, sizes[group.rank])
