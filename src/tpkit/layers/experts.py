"""A mixture-of-experts MLP (Mixtral: top-k routing), tensor- or expert-parallel.

    x [b, s, h] --f--> router (replicated): softmax(x W_r^T) -> top-k experts, weights
                  |--> expert e (its tokens only): fc1_e -> act -> fc2_e
                  |    partial [n_e, h] * weight, added into one partial [b*s, h]
    sum of this rank's partials --g--> ONE all-reduce -> [b, s, h]

The experts' weights are stacked, fc1 = [gate_0; up_0; gate_1; up_1; ...] [E*2f, h] and
fc2 = [down_0; down_1; ...] [E*h, f], and split one of two ways (the split tags say
which, so a checkpoint loads in either layout):

    tensor-parallel (default)   every expert split like the Megatron MLP: each rank
                                holds f/tp of every expert's gate, up (rows) and down
                                (columns); fc2 gives partial sums
    expert-parallel             each rank holds E/tp whole experts; tokens are already
                                on every rank (replicated activations), so no all-to-all:
                                a rank computes its experts for the tokens routed there

Either way each rank's output is a partial sum and the experts add up locally before
the single g, so a layer sends exactly what the dense MLP sends (one all-reduce
forward, one backward through f), whatever the number of experts.

The router reads the same f-copied x and is replicated: every rank picks the same
experts. Its gradient, though, comes through partial expert outputs, so each rank's
router (and its dx) is a partial sum: the dx joins the experts' before f's backward
all-reduce, and the router weight is tagged for the tp sum (`finalize_tp_grads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.comm import ops
from tpkit.comm.group import CommGroup
from tpkit.layers.mlp import GATED, activate
from tpkit.layers.sharding import TPSplit, master_normal, seed_for, set_meta, shard
from tpkit.spec.config import ModelConfig
from tpkit.spec.shapes import even_range


def expert_splits(num_experts: int, hidden: int, ffn: int, gated: bool, tp: int,
                  expert_parallel: bool) -> tuple[TPSplit, TPSplit]:
    """Split tags of the stacked fc1 [E*(2)f, h] and fc2 [E*h, f]: whole experts dealt
    over tp (expert parallel), or each expert's ffn columns dealt over tp, as evenly as
    possible either way."""
    width = (2 if gated else 1) * ffn
    if expert_parallel:
        if num_experts < tp:
            raise ValueError(f"num_experts={num_experts} is fewer than tp={tp} "
                             f"(expert parallelism spreads whole experts over tp)")
        return (TPSplit.even(0, num_experts * width, num_experts),
                TPSplit.even(0, num_experts * hidden, num_experts))
    parts = width // ffn * num_experts
    return TPSplit(0, (ffn,) * parts), TPSplit.even(1, ffn)


def _stacked(full_shape: tuple[int, int], split: TPSplit, group: CommGroup, std: float,
             seed: int, kw: dict) -> nn.Module:
    """A holder whose `.weight` is this rank's slice of a stacked expert weight."""
    holder = nn.Module()
    local = list(full_shape)
    local[split.dim] = split.local_size(group.rank, group.size)
    holder.weight = set_meta(nn.Parameter(torch.empty(local, **kw)), split=split)
    if not holder.weight.is_meta:
        with torch.no_grad():
            holder.weight.copy_(shard(master_normal(full_shape, std, seed), split, group.rank,
                                      group.size))
    return holder


class ParallelMoE(nn.Module):
    """Top-k routed experts (Mixtral's router: softmax, top-k, renormalized)."""

    @classmethod
    def from_config(cls, c: ModelConfig, group: CommGroup, *, sequence_parallel: bool = False,
                    expert_parallel: bool = False, seed: int = 0, out_std: float | None = None,
                    device=None, dtype=None) -> ParallelMoE:
        """The experts of a transformer layer of `c` (`num_experts` > 0), over `group`."""
        return cls(c.hidden, c.ffn, group, num_experts=c.num_experts, top_k=c.experts_per_token,
                   activation=c.activation, sequence_parallel=sequence_parallel,
                   expert_parallel=expert_parallel, init_std=c.init_std, out_std=out_std,
                   seed=seed, device=device, dtype=dtype)

    def __init__(self, hidden: int, ffn: int, group: CommGroup, *, num_experts: int,
                 top_k: int = 2, activation: str = "swiglu", sequence_parallel: bool = False,
                 expert_parallel: bool = False, init_std: float = 0.02,
                 out_std: float | None = None, seed: int = 0, device=None, dtype=None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} is not in 1..num_experts={num_experts}")
        tp, gated = group.size, activation in GATED
        s1, s2 = expert_splits(num_experts, hidden, ffn, gated, tp, expert_parallel)
        self.group, self.top_k, self.activation = group, top_k, activation
        self.sequence_parallel, self.hidden = sequence_parallel, hidden
        first, per_rank = even_range(num_experts, tp, group.rank) if expert_parallel else (
            0, num_experts)
        self.local_experts = range(first, first + per_rank)  # experts this rank computes
        kw = dict(device=device, dtype=dtype)
        self.router = nn.Linear(hidden, num_experts, bias=False, **kw)
        set_meta(self.router.weight, sequence_parallel=True)  # partial gradient per tp rank: summed
        if not self.router.weight.is_meta:
            with torch.no_grad():
                self.router.weight.copy_(master_normal((num_experts, hidden), init_std,
                                                       seed_for(seed, "router")))
        width = (2 if gated else 1) * ffn
        self.fc1 = _stacked((num_experts * width, hidden), s1, group, init_std,
                            seed_for(seed, "fc1"), kw)
        self.fc2 = _stacked((num_experts * hidden, ffn), s2, group, out_std or init_std,
                            seed_for(seed, "fc2"), kw)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, h] -> (weights [n, k] renormalized over the top k, expert ids [n, k])."""
        probs = F.softmax(self.router(x).float(), dim=-1)  # [n, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [n, k]
        return weights / weights.sum(-1, keepdim=True), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, h] ([b, s/tp, h] with SP) -> same shape; one all-reduce forward."""
        if self.sequence_parallel:
            x = ops.gather_from_sp(x, self.group)  # [b, s, h]; backward reduce-scatter
        else:
            x = ops.copy_to_tp(x, self.group)  # identity; backward all-reduce
        b, s, h = x.shape
        flat = x.reshape(b * s, h)  # [n, h]
        weights, ids = self.route(flat)  # [n, k] each, identical on every rank
        n = len(self.local_experts)
        w1 = self.fc1.weight.view(n, -1, h)  # [E_local, 2f/tp or 2f, h]
        w2 = self.fc2.weight.view(n, h, -1)  # [E_local, h, f/tp or f]
        out = torch.zeros_like(flat)  # [n, h], this rank's partial sum
        for j, e in enumerate(self.local_experts):
            token, slot = torch.where(ids == e)  # the tokens routed to expert e
            if token.numel() == 0:
                continue
            y = activate(F.linear(flat[token], w1[j]), self.activation)  # [n_e, f/tp]
            y = F.linear(y, w2[j])  # [n_e, h], partial
            out = out.index_add(0, token, y * weights[token, slot, None].to(y.dtype))
        out = out.view(b, s, h)
        if self.sequence_parallel:
            return ops.reduce_scatter_to_sp(out, self.group)  # [b, s/tp, h]
        return ops.reduce_from_tp(out, self.group)  # [b, s, h]
