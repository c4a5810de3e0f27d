"""Gradient sums that tensor parallelism owes after backward (Megatron's finalize step).

Two kinds of parameter are held by several tp ranks that each see only part of
the data flowing through them, so each rank's gradient is a partial sum:

- with sequence parallelism, norm weights (and row-parallel biases) act on this
  rank's [b, s/tp, h] slice only: their gradients are summed over the tp group;
- grouped-query kv heads replicated over tp (num_kv_heads < tp): the ranks sharing
  a kv head each hold the gradient from their own query heads: summed over sharers;
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
from tpkit.comm.group import CommGroup
from tpkit.sharding import SP_TAG, split_of


def finalize_tp_grads(module: nn.Module, group: CommGroup) -> None:
    """Sum the partial gradients of replicated-but-partial and shared-chunk parameters."""
    if group.size == 1:
        return
    sp = [p for p in module.parameters() if getattr(p, SP_TAG, False) and p.grad is not None]
    if sp:
        flat = torch.cat([p.grad.reshape(-1) for p in sp])  # one all-reduce for all of them
        all_reduce(flat, group, phase="grads", scope="partial_grad_params")
        offset = 0
        for p in sp:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
    for p in module.parameters():
        split = split_of(p)
        if p.grad is not None and split is not None and split.shared(group.size):
            _sum_shared_chunks(p, group)


def _sum_shared_chunks(p: nn.Parameter, group: CommGroup) -> None:
    """Each part with chunks < tp: place this rank's chunk grad at its global position,
    all-reduce over tp, read the chunk back: the sum over the ranks that share it."""
    split, tp, rank = split_of(p), group.size, group.rank
    offset = 0
    for i, (size, n) in enumerate(zip(split.parts, split.chunks)):
        c = size // n
        if n < tp:
            local = p.grad.narrow(split.dim, offset, c)  # this rank's chunk of part i
            shape = list(p.grad.shape)
            shape[split.dim] = size
            buf = torch.zeros(shape, dtype=p.grad.dtype, device=p.grad.device)  # [part i, ...]
            j = split.chunk_index(i, rank, tp)
            buf.narrow(split.dim, j * c, c).copy_(local)
            all_reduce(buf, group, phase="grads", scope="shared_kv_params")
            # every sharer added its own chunk j: the sum holds tp/n contributions of chunk j
            local.copy_(buf.narrow(split.dim, j * c, c))
        offset += c
