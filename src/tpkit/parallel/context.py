"""Context parallelism: each sequence split over cp ranks, attention as a ring.

The cp ranks of one model replica are carved out of the data-parallel dimension of the
mesh: with dp replicas of cp ranks each, the mesh is built with dp x cp data-parallel
ranks, and mesh dp index d = replica * cp + c (cp innermost, the closest ranks):

    tp=1, pp=1, dp=2, cp=2:   ranks 0 1 | 2 3      cp groups (0 1), (2 3)
                              replica 0 | 1        dp x cp group (0 1 2 3)

All dp x cp ranks hold the same weights: gradients are averaged over the whole group
(the existing data-parallel sync, ZeRO or FSDP), which is the gradient of the mean loss
because each cp rank's loss is the mean over its S/cp tokens (the same number on every
rank). The loader hands a replica its sequences; each cp rank keeps its two chunks
(`tpkit.spec.shapes.cp_chunks`), and the embedding and rotary angles use the tokens'
global positions. Attention is `tpkit.layers.ring_attention`.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm.group import CommGroup
from tpkit.layers.attention import ParallelAttention
from tpkit.mesh import ParallelMesh
from tpkit.spec.grid import Coord, rank_of
from tpkit.spec.shapes import cp_chunks


def context_group(mesh: ParallelMesh, cp: int) -> CommGroup | None:
    """This rank's cp group (None with cp=1). Collective: every rank calls it."""
    if cp == 1:
        return None
    if mesh.dp_size % cp:
        raise ValueError(f"the mesh's dp={mesh.dp_size} is not a multiple of cp={cp}")
    tp, pp = mesh.tp_size, mesh.pp_size
    groups = [tuple(rank_of(Coord(r * cp + c, p, t), tp, pp) for c in range(cp))
              for r in range(mesh.dp_size // cp) for p in range(pp) for t in range(tp)]
    return mesh.extra_group("context-parallel", "cp", groups)


def enable(model: nn.Module, group: CommGroup) -> None:
    """Ring attention in every layer, global positions in the embedding."""
    for m in model.modules():
        if isinstance(m, ParallelAttention):
            m.cp = group
    if getattr(model, "is_first_stage", False):
        model.embed.cp = group


def local_chunks(ids: torch.Tensor, labels: torch.Tensor, group: CommGroup | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, S] ids and labels -> this cp rank's two chunks, [b, S/cp] each."""
    if group is None:
        return ids, labels
    spans = cp_chunks(ids.shape[1], group.size, group.rank)
    return tuple(torch.cat([t[:, a:b] for a, b in spans], dim=1) for t in (ids, labels))


def expected(model: nn.Module, b: int, s_local: int, cp: int, micro_batches: int,
             recompute: str = "none") -> list:
    """`tpkit.spec.theory.context_parallel` for this stage's layers."""
    from tpkit.spec import theory

    attn = [m for m in model.modules() if isinstance(m, ParallelAttention)]
    if not attn:
        return []
    return theory.context_parallel(b, s_local, attn[0].ring_heads, attn[0].head_dim, cp,
                                   len(attn), micro_batches, recompute)
