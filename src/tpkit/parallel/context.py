"""Context parallelism: each sequence split over cp ranks, attention as a ring.

The cp ranks are a dimension of the mesh of their own (`ParallelMesh(tp, pp, dp, cp)`,
cp right outside tp in `tpkit.spec.grid`): `mesh.cp_group` is this rank's ring, and
the model built on the mesh uses it (ring attention in every layer, global positions
in the embedding):

    tp=1, pp=1, dp=2, cp=2:   ranks 0 1 | 2 3      cp groups (0 1), (2 3)
                              replica 0 | 1        dp x cp group (0 1 2 3)

All dp x cp ranks hold the same weights: gradients are averaged over the whole group
(`mesh.dp_cp_group`: the data-parallel sync, ZeRO or FSDP), which is the gradient of
the mean loss because each cp rank's loss is the mean over its S/cp tokens (the same
number on every rank). The loader hands a replica (`mesh.dp_rank`) its sequences; each
cp rank keeps its two chunks (`tpkit.spec.shapes.cp_chunks`), and the embedding and
rotary angles use the tokens' global positions. Attention is `tpkit.layers.ring_attention`.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm.group import CommGroup
from tpkit.layers.attention import ParallelAttention
from tpkit.spec import theory
from tpkit.spec.shapes import cp_chunks


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
    attn = [m for m in model.modules() if isinstance(m, ParallelAttention)]
    if not attn:
        return []
    return theory.context_parallel(b, s_local, attn[0].ring_heads, attn[0].head_dim, cp,
                                   len(attn), micro_batches, recompute)
