"""Gradient synchronisation after backward: tied embeddings across stages, then dp.

Data parallelism (each dp replica a different slice of the batch): after the last
micro-batch every gradient is averaged over `mesh.dp_cp_group`. Gradients are packed
into flat buckets (~`bucket_mb` MiB each) so that a model of many small tensors
costs a few all-reduces, not one per parameter:

    grads [g0 g1 g2 | g3 g4 | ...]  --flatten-->  bucket --all_reduce(dp)/dp--> unflatten

`OverlappedGradSync` does the same while backward is still running (as PyTorch's
DDP does): buckets are filled in the order backward finishes parameters (last layer
first), and a bucket's all-reduce starts as soon as each of its parameters has
received its gradient from the last micro-batch.

Tied embeddings with pp > 1: the first stage owns `embed.word.weight`, the last
stage owns `head.weight` (its `ParamMeta.tied_to` names the table), the same
matrix. Each gets only its own use's gradient, so the two are summed over a group
of {first, last} stage with the same tp and dp index (Megatron's "embedding
group"), which keeps them equal.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm import all_reduce
from tpkit.comm.collectives import Pending, all_reduce_async
from tpkit.comm.flat import all_reduce_flat, pack, unpack_into
from tpkit.comm.group import CommGroup
from tpkit.layers.sharding import meta_of
from tpkit.mesh import ParallelMesh
from tpkit.model.names import EMBED_WEIGHT
from tpkit.spec.grid import tied_pairs


def allreduce_grads(params: list[nn.Parameter], group: CommGroup, *, average: bool = True,
                    bucket_mb: float = 25.0) -> None:
    """Sum (or average) the gradients of `params` over `group`, in flat buckets."""
    if group.size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads, int(bucket_mb * 2**20)):
        all_reduce_flat(bucket, group, average=average, phase="grads", scope="data_parallel")


class OverlappedGradSync:
    """Average gradients over `group` in buckets started during the last backward."""

    def __init__(self, params: list[nn.Parameter], group: CommGroup, micro_batches: int,
                 bucket_mb: float = 25.0) -> None:
        self.group, self.micro_batches = group, micro_batches
        order = list(reversed([p for p in params if p.requires_grad]))  # backward order
        self.buckets = _buckets(order, int(bucket_mb * 2**20))
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._count: dict[int, int] = {}
        self._pending: dict[int, tuple[Pending, torch.Tensor]] = {}
        self._armed = False
        if group.size > 1:
            for p in order:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        """Call before the step's first backward."""
        self._count.clear()
        self._pending.clear()
        self._armed = self.group.size > 1

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        self._count[id(p)] = self._count.get(id(p), 0) + 1
        i = self._bucket_of[id(p)]
        if i not in self._pending and all(self._count.get(id(q), 0) >= self.micro_batches
                                          for q in self.buckets[i]):
            self._start(i)

    def _start(self, i: int) -> None:
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in self.buckets[i]]
        flat = pack(grads)  # [sum numel]
        self._pending[i] = (all_reduce_async(flat, self.group, phase="grads",
                                             scope="data_parallel"), flat)

    def finish(self) -> None:
        """Start what has not started, wait for everything, write the averages back."""
        if not self._armed:
            return
        for i in range(len(self.buckets)):
            if i not in self._pending:
                self._start(i)
        for i, (pending, flat) in sorted(self._pending.items()):
            pending.wait()
            flat /= self.group.size
            for q in self.buckets[i]:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
            unpack_into(flat, [q.grad for q in self.buckets[i]])
        self._armed = False


def _buckets(grads: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of same-dtype gradients, each at most `limit` bytes (or one)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not out or size + nbytes > limit or out[-1][0].dtype != g.dtype:
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out


def tied_embedding_group(mesh: ParallelMesh, tied: bool) -> CommGroup | None:
    """This rank's {first stage, last stage} group (same tp, cp, dp index), or None.

    Collective: every rank must call it with the same `tied` (the model's
    tie_embeddings); with pp > 1 each rank then creates every group in the same
    order, as torch.distributed.new_group requires.
    """
    if mesh.pp_size == 1 or not tied:
        return None
    pairs = tied_pairs(mesh.tp_size, mesh.pp_size, mesh.dp_size, mesh.cp_size)
    return mesh.extra_group("tied-embedding", "tied", pairs)


def tied_params(model: nn.Module) -> list[nn.Parameter]:
    """This stage's halves of the tied pairs: the last stage's head (`tied_to` set),
    the first stage's word embedding."""
    named = sorted(model.named_parameters())
    out = [p for _, p in named if meta_of(p).tied_to]
    targets = {meta_of(p).tied_to for p in out} or {EMBED_WEIGHT}
    return out + [p for n, p in named if n in targets]


def sync_tied_grads(model: nn.Module, group: CommGroup | None) -> None:
    """Sum the gradients of the tied parameters between the first and the last stage."""
    if group is None:
        return
    params = tied_params(model)
    if len(params) != 1:
        raise RuntimeError(f"expected one tied parameter on this stage, found {len(params)}")
    p = params[0]
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    all_reduce(p.grad, group, phase="grads", scope="tied_embedding")
