"""Gradient sums that tensor parallelism owes after backward (Megatron's finalize step).

Two kinds of parameter are held by several tp ranks that each see only part of
the data flowing through them, so each rank's gradient is a partial sum:

- with sequence parallelism, norm weights (and row-parallel biases) act on this
  rank's [b, s/tp, h] slice only: their gradients are summed over the tp group;
- grouped-query kv heads held by several ranks (kv_heads < tp, or query ranges that
  straddle a kv group, 9 heads / 3 kv at tp=2): the ranks holding a kv head each hold
  the gradient from their own query heads: summed over the holders;
- weights replicated but fed by split work: the per-head q/k norms (each rank
  normalizes its own heads) and a mixture-of-experts router (its gradient comes
  through each rank's partial expert outputs): summed over tp, like the SP norms.

Call `finalize_tp_grads(model, group)` once after backward (after the last
micro-batch when accumulating), before clipping and the optimizer step.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm import all_reduce
from tpkit.comm.flat import all_reduce_flat
from tpkit.comm.group import CommGroup
from tpkit.layers.sharding import meta_of


def finalize_tp_grads(module: nn.Module, group: CommGroup) -> None:
    """Sum the partial gradients of replicated-but-partial and shared-chunk parameters."""
    finalize_param_grads(list(module.parameters()), group)


def finalize_param_grads(params: list[nn.Parameter], group: CommGroup) -> None:
    """`finalize_tp_grads` for some parameters only (ZeRO-2 and FSDP call it per unit,
    before the unit's gradients are reduce-scattered over dp and dropped)."""
    if group.size == 1:
        return
    sp = [p.grad for p in params if meta_of(p).sequence_parallel and p.grad is not None]
    if sp:  # one all-reduce for all of them
        all_reduce_flat(sp, group, phase="grads", scope="partial_grad_params")
    for p in params:
        split = meta_of(p).split
        if p.grad is not None and split is not None and split.shared(group.size):
            _sum_shared_chunks(p, group)


def _sum_shared_chunks(p: nn.Parameter, group: CommGroup) -> None:
    """Each part some of whose rows several ranks hold: place this rank's rows of the
    part at their global position, all-reduce over tp, read them back: the sum over the
    ranks that hold each row (one all-reduce per shared part, on every rank alike)."""
    split, tp = meta_of(p).split, group.size
    local_start = 0
    for i, size in enumerate(split.parts):
        at, n = split.part_range(i, group.rank, tp)  # this rank's rows of part i
        if split.part_shared(i, tp):
            local = p.grad.narrow(split.dim, local_start, n)
            shape = list(p.grad.shape)
            shape[split.dim] = size
            buf = torch.zeros(shape, dtype=p.grad.dtype, device=p.grad.device)  # [part, ...]
            buf.narrow(split.dim, at, n).copy_(local)
            all_reduce(buf, group, phase="grads", scope="shared_kv_params")
            local.copy_(buf.narrow(split.dim, at, n))
        local_start += n
