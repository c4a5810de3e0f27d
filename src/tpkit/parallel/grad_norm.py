"""The global gradient norm of a 3D-parallel model, each parameter counted once.

    ||g||^2 =   sum over tp-split params of every tp rank's shard   (disjoint pieces)
              + sum over tp-replicated params, from tp rank 0 only  (same on every rank)
              , summed over pp stages                                (disjoint layers)
              - the tied head on the last stage                      (= the embedding)
    and NOT summed over dp: after averaging, every replica holds the same gradients
    (with ZeRO-1 each holds its slice and zeros elsewhere: then summed over dp too).

Rows of a split held by several ranks (grouped-query kv heads read by several
ranks' query heads: `Piece.holders` > 1) appear `holders` times in the tp sum, so
they are weighted by 1/holders. One all-reduce of one float over the tp x pp group.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tpkit.comm import all_reduce
from tpkit.layers.sharding import meta_of
from tpkit.mesh import ParallelMesh


def local_sq_norm(model: nn.Module, tp_size: int, tp_rank: int, pp_size: int) -> torch.Tensor:
    """This rank's share of ||g||^2 (float64 scalar), as described in the module doc."""
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None or (pp_size > 1 and meta_of(p).tied_to):
            continue
        g = p.grad.detach().double()
        split = meta_of(p).split
        if split is None or tp_size == 1:
            if tp_rank == 0:
                total += g.square().sum().cpu()
        elif not split.shared(tp_size):
            total += g.square().sum().cpu()
        else:
            for pc in split.pieces(tp_rank, tp_size):
                piece = g.narrow(split.dim, pc.local_start, pc.size)
                total += piece.square().sum().cpu() / pc.holders
    return total


def global_grad_norm(model: nn.Module, mesh: ParallelMesh, dp_sharded: bool = False) -> float:
    """||g||_2 over the whole model (one replica), identical on every rank."""
    sq = local_sq_norm(model, mesh.tp_size, mesh.tp_rank, mesh.pp_size).to(mesh.device)
    all_reduce(sq, mesh.mp_group, phase="grads", scope="grad_norm")
    if dp_sharded:
        all_reduce(sq, mesh.dp_group, phase="grads", scope="grad_norm")
    return math.sqrt(sq.item())


def clip_grads(model: nn.Module, norm: float, max_norm: float) -> float:
    """Scale every gradient by min(1, max_norm / norm); returns the factor used."""
    if max_norm <= 0 or norm <= max_norm or not math.isfinite(norm):
        return 1.0
    factor = max_norm / (norm + 1e-6)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)
    return factor
