"""Flat units: a group of parameters as one flat fp32 buffer, sharded over dp.

ZeRO-2 (gradient buckets) and FSDP (one unit per transformer layer) both keep, per
unit, this rank's 1/dp slice of the flattened parameters and of their averaged
gradients; the model's parameters are views of the unit's full buffer:

    params [w0 | w1 | b0 | pad]        decayed matrices first, then vectors, padded to dp
    flat   [   r0   |   r1   |  ...  ]  the full buffer; w0, w1, b0 are views of it
    shard  [   r  ]                    this rank's slice (fp32, what AdamW updates)
    grads  reduce_scatter(dp) / dp of the packed .grad of each backward -> += grad shard

FSDP frees the full buffer between uses by resizing its storage to zero bytes (the
parameters, and any view autograd saved of them, stay valid and read the data again
once the buffer is refilled), and refills it with one all-gather of the shards.

The global gradient norm reads the shards: each element carries the weight the
unsharded norm gives it (`tpkit.parallel.grad_norm`): 1 for a tp-split element, 1 on
tp rank 0 only for a replicated one, 1/holders for grouped-query kv rows held by
several ranks, 0 for the tied head of a pipeline's last stage and for the padding.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm import all_gather, reduce_scatter
from tpkit.comm.collectives import Pending, all_gather_async
from tpkit.comm.flat import pack
from tpkit.comm.group import CommGroup
from tpkit.layers.grads import finalize_param_grads
from tpkit.layers.sharding import meta_of


def norm_weight(p: nn.Parameter, tp_size: int, tp_rank: int, pp_size: int) -> torch.Tensor:
    """Per-element weight of `p` in the global squared gradient norm (shape of `p`)."""
    meta = meta_of(p)
    w = torch.zeros(p.shape, dtype=torch.float64, device=p.device)
    if pp_size > 1 and meta.tied_to:
        return w  # counted once, as the first stage's embedding
    split = meta.split
    if split is None or tp_size == 1:
        return w.fill_(1.0 if tp_rank == 0 else 0.0)
    if not split.shared(tp_size):
        return w.fill_(1.0)
    for pc in split.pieces(tp_rank, tp_size):
        w.narrow(split.dim, pc.local_start, pc.size).fill_(1 / pc.holders)
    return w


class FlatUnit:
    """Parameters sharded as one flat buffer over `group` (dp); see the module doc."""

    def __init__(self, name: str, params: list[nn.Parameter], group: CommGroup,
                 tp_group: CommGroup, pp_size: int, shard_is_view: bool = False) -> None:
        self.name, self.group, self.tp_group = name, group, tp_group
        self.params = sorted(params, key=lambda p: p.dim() < 2)  # decayed first (stable)
        n = sum(p.numel() for p in self.params)
        self.padded = -(-n // group.size) * group.size
        self.per = self.padded // group.size
        self.lo = group.rank * self.per
        decayed = sum(p.numel() for p in self.params if p.dim() >= 2)
        self.decayed = min(max(decayed - self.lo, 0), self.per)  # of the shard's elements
        dev = self.params[0].device
        self.flat = torch.zeros(self.padded, dtype=torch.float32, device=dev)  # [n padded]
        weights = torch.zeros(self.padded, dtype=torch.float64, device=dev)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                k = p.numel()
                self.flat[offset:offset + k].copy_(p.detach().reshape(-1))
                weights[offset:offset + k] = norm_weight(p, tp_group.size, tp_group.rank,
                                                         pp_size).reshape(-1)
                p.data = self.flat[offset:offset + k].view_as(p)
                offset += k
        # [n/dp] fp32 master: its own copy (FSDP frees the buffer), or with replicated
        # weights (ZeRO-2) a view of the buffer, updated in place, so no second copy
        self.shard = self.flat[self.lo:self.lo + self.per]
        self.shard_is_view = shard_is_view
        if not shard_is_view:
            self.shard = self.shard.clone()
        self.norm_w = weights[self.lo:self.lo + self.per].clone()  # [n/dp]
        self.grad_shard: torch.Tensor | None = None
        self.gathered = True
        self._pending: Pending | None = None

    # -- weights ---------------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, phase: str, scope: str) -> None:
        """Refill the full buffer from every rank's shard (one all-gather), unless full."""
        if self._pending is not None:
            self.wait()
        if self.gathered:
            return
        self._storage().resize_(self.padded * self.flat.element_size())
        self.flat.copy_(all_gather(self.shard, self.group, dim=0, phase=phase, scope=scope))
        self.gathered = True

    @torch.no_grad()
    def prefetch(self, phase: str, scope: str) -> None:
        """Start the all-gather now (async); the next `gather` or `wait` completes it."""
        if self.gathered or self._pending is not None or self.group.size == 1:
            return
        self._storage().resize_(self.padded * self.flat.element_size())
        self._pending = all_gather_async(self.shard, self.group, out=self.flat, phase=phase,
                                         scope=scope)

    def wait(self) -> None:
        """Finish a prefetch."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            self.gathered = True

    def free(self) -> None:
        """Drop the full buffer (the parameters keep their shapes, not their bytes)."""
        if self.group.size > 1 and self.gathered:
            self._storage().resize_(0)
            self.gathered = False

    @torch.no_grad()
    def publish(self, scope: str) -> None:
        """After the optimizer step: every rank's updated shard into the full buffer."""
        self._storage().resize_(self.padded * self.flat.element_size())
        mine = self.shard.clone() if self.shard_is_view else self.shard  # not read while written
        self.flat.copy_(all_gather(mine, self.group, dim=0, phase="grads", scope=scope))
        self.gathered = True

    @torch.no_grad()
    def take_from_params(self) -> None:
        """The shard re-read from the full buffer (after weights were loaded into it)."""
        if not self.shard_is_view:
            self.shard.copy_(self.flat[self.lo:self.lo + self.per])

    def _storage(self):
        return self.flat.untyped_storage()

    # -- gradients -------------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, scope: str) -> None:
        """tp sums, then reduce-scatter the packed gradients over dp, averaged, into the
        gradient shard; the full gradients are dropped."""
        finalize_param_grads(self.params, self.tp_group)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = pack(grads)  # [n]
        if flat.numel() < self.padded:
            flat = torch.cat([flat, flat.new_zeros(self.padded - flat.numel())])  # [n padded]
        mine = reduce_scatter(flat, self.group, dim=0, phase="grads", scope=scope)  # [n/dp]
        mine = mine / self.group.size
        self.grad_shard = mine if self.grad_shard is None else self.grad_shard.add_(mine)
        for p in self.params:
            p.grad = None

    def sq_norm(self) -> torch.Tensor:
        """This rank's weighted share of the squared gradient norm (float64 scalar)."""
        if self.grad_shard is None:
            return torch.zeros((), dtype=torch.float64, device=self.shard.device)
        return (self.grad_shard.double().square() * self.norm_w).sum()
