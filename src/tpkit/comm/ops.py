"""The conjugate autograd operators of Megatron-LM (Shoeybi et al. 2019, section 3).

    f = copy_to_tp       forward: identity              backward: all-reduce
    g = reduce_from_tp   forward: all-reduce            backward: identity
    scatter_to_tp        forward: keep own slice (-1)   backward: all-gather (-1)
    gather_from_tp       forward: all-gather (-1)       backward: keep own slice
    scatter_to_sp        forward: keep own seq slice    backward: all-gather seq
    gather_from_sp       forward: all-gather seq        backward: reduce-scatter seq
    reduce_scatter_to_sp forward: reduce-scatter seq    backward: all-gather seq

A column-parallel layer starts with f, a row-parallel one ends with g: between them
nothing is sent. Sequence parallelism (Korthikanti et al. 2022) replaces f by
gather_from_sp and g by reduce_scatter_to_sp on the sequence dimension (dim 1 of
[b, s, h]). Every operator takes its group explicitly.

The sequence need not divide over the group: rank r holds part r of
`spec.shapes.even_sizes(s, tp)` (s=7, tp=2: 4 + 3), and the SP collectives pad every
part to the largest (`comm.parts`). An operator that starts from the whole sequence
(scatter_to_sp, reduce_scatter_to_sp) sees s; gather_from_sp starts from a part, which
does not say s: inside `with sequence(group, s):` it gathers parts of s, outside it
assumes equal parts (s = part * tp), as when tp divides s.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tpkit.comm import collectives as C
from tpkit.comm import parts
from tpkit.comm.group import CommGroup
from tpkit.spec.shapes import even_range, even_sizes

SEQ_DIM = 1  # activations are [b, s, h]


@contextmanager
def sequence(group: CommGroup, seq: int) -> Iterator[None]:
    """Inside the block, the sequence-parallel tensors on `group` are parts of a sequence
    of `seq` tokens (`spec.shapes.even_sizes`): what gather_from_sp needs to gather an
    uneven split. The operators keep the sizes for their backward."""
    before, group.sp_seq = group.sp_seq, seq
    try:
        yield
    finally:
        group.sp_seq = before


def sp_sizes(group: CommGroup, local: int) -> list[int]:
    """Every rank's part of the sequence, this rank holding `local` tokens: the parts of
    `group.sp_seq` inside `sequence`, else `local` on every rank."""
    if group.sp_seq is None:
        return [local] * group.size
    sizes = even_sizes(group.sp_seq, group.size)
    if sizes[group.rank] != local:
        raise ValueError(f"{group.name} rank {group.rank} holds {local} tokens; its part of "
                         f"a sequence of {group.sp_seq} over {group.size} ranks is "
                         f"{sizes[group.rank]}")
    return sizes


def _own_slice(x: torch.Tensor, group: CommGroup, dim: int, even: bool = True) -> torch.Tensor:
    """This rank's slice of `dim`: an equal share (`even`), else its `even_range` part."""
    size = x.shape[dim]
    if even and size % group.size:
        raise ValueError(f"dimension {dim} of size {size} does not split over "
                         f"{group.name}={group.size} ranks")
    start, n = even_range(size, group.size, group.rank)
    return x.narrow(dim, start, n).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.scope = group, group.ledger.current_scope()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous(), ctx.group, phase="backward", scope=ctx.scope), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous() or (x.is_leaf and x.requires_grad):  # a leaf stays intact
            return C.all_reduce(x.clone(memory_format=torch.contiguous_format), group)
        ctx.mark_dirty(x)  # in place: autograd errors out if anything saved x for backward
        return C.all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.scope = group, dim, group.ledger.current_scope()
        return _own_slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, ctx.group, ctx.dim, phase="backward", scope=ctx.scope), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return C.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.group, ctx.dim), None, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.scope = group, dim, group.ledger.current_scope()
        ctx.sizes = even_sizes(x.shape[dim], group.size)
        return _own_slice(x, group, dim, even=False)

    @staticmethod
    def backward(ctx, grad):
        g = parts.all_gather_parts(grad.contiguous(), ctx.group, ctx.sizes, ctx.dim,
                                   phase="backward", scope=ctx.scope)
        return g, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.scope = group, dim, group.ledger.current_scope()
        ctx.sizes = even_sizes(x.shape[dim], group.size)
        return parts.reduce_scatter_parts(x, group, ctx.sizes, dim)

    @staticmethod
    def backward(ctx, grad):
        g = parts.all_gather_parts(grad.contiguous(), ctx.group, ctx.sizes, ctx.dim,
                                   phase="backward", scope=ctx.scope)
        return g, None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.scope = group, dim, group.ledger.current_scope()
        ctx.sizes = sp_sizes(group, x.shape[dim])
        return parts.all_gather_parts(x, group, ctx.sizes, dim)

    @staticmethod
    def backward(ctx, grad):
        g = parts.reduce_scatter_parts(grad, ctx.group, ctx.sizes, ctx.dim, phase="backward",
                                       scope=ctx.scope)
        return g, None, None


def _skip(group: CommGroup) -> bool:
    return group.size == 1


def copy_to_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return x if _skip(group) or not torch.is_grad_enabled() else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """g: all-reduce forward (sums the partial outputs), identity backward. Where no
    gradient is taken (a decode) the all-reduce alone, without the autograd Function
    around it (its call costs as much as a small all-reduce on shared memory)."""
    if _skip(group):
        return x
    if torch.is_grad_enabled():
        return _ReduceFromTP.apply(x, group)
    if not x.is_contiguous() or (x.is_leaf and x.requires_grad):  # as the Function does
        x = x.clone(memory_format=torch.contiguous_format)
    return C.all_reduce(x, group)


def scatter_to_tp(x: torch.Tensor, group: CommGroup, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice of `dim` forward; all-gather the gradient backward."""
    return x if _skip(group) else _ScatterToTP.apply(x, group, dim)


def gather_from_tp(x: torch.Tensor, group: CommGroup, dim: int = -1) -> torch.Tensor:
    """All-gather `dim` forward; keep this rank's slice of the gradient backward."""
    return x if _skip(group) else _GatherFromTP.apply(x, group, dim)


def scatter_to_sp(x: torch.Tensor, group: CommGroup, dim: int = SEQ_DIM) -> torch.Tensor:
    """Enter sequence-parallel form: keep this rank's part of the sequence (uneven where
    the group does not divide it); all-gather the gradient backward."""
    return x if _skip(group) else _ScatterToSP.apply(x, group, dim)


def gather_from_sp(x: torch.Tensor, group: CommGroup, dim: int = SEQ_DIM) -> torch.Tensor:
    """All-gather the sequence forward (parts of `group.sp_seq` inside `sequence`);
    reduce-scatter the gradient backward."""
    return x if _skip(group) else _GatherFromSP.apply(x, group, dim)


def reduce_scatter_to_sp(x: torch.Tensor, group: CommGroup, dim: int = SEQ_DIM) -> torch.Tensor:
    """Sum partial outputs and keep this rank's part of the sequence (uneven where the
    group does not divide it); all-gather backward."""
    return x if _skip(group) else _ReduceScatterToSP.apply(x, group, dim)
