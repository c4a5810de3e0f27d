"""A mixture-of-experts MLP (Mixtral: top-k routing), every expert split over tp.

    x [b, s, h] --f--> router (replicated): softmax(x W_r^T) -> top-k experts, weights
                  |--> expert e (its tokens only): fc1_e (column) -> act -> fc2_e (row)
                  |    partial [n_e, h] * weight, added into one partial [b*s, h]
    sum of every expert's partial --g--> ONE all-reduce -> [b, s, h]

Each expert is the Megatron MLP, so its fc2 output on a rank is a partial sum; the
routing weights scale partials and the experts add up before the single g, so a
layer sends exactly what the dense MLP sends (one all-reduce forward, one backward
through f), whatever the number of experts.

The router reads the same f-copied x and is replicated: every rank picks the same
experts. Its gradient, though, comes through partial expert outputs, so each
rank's router (and its dx) is a partial sum: the dx joins the experts' before f's
backward all-reduce, and the router weight is tagged for the tp sum
(`finalize_tp_grads`, once per step, like the sequence-parallel norms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.comm import ops
from tpkit.comm.group import CommGroup
from tpkit.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpkit.layers.mlp import GATED, activate
from tpkit.sharding import SP_TAG, master_normal, seed_for, tag


class Expert(nn.Module):
    """One expert's weights: fc1 column-parallel ([gate; up] if gated), fc2 row-parallel."""

    def __init__(self, hidden: int, ffn: int, group: CommGroup, activation: str, seed: int,
                 init_std: float, out_std: float, kw: dict) -> None:
        super().__init__()
        gated = activation in GATED
        self.fc1 = ColumnParallelLinear(hidden, 2 * ffn if gated else ffn, group, bias=False,
                                        partition_sizes=[ffn, ffn] if gated else None,
                                        init_std=init_std, seed=seed_for(seed, "fc1"), **kw)
        self.fc2 = RowParallelLinear(ffn, hidden, group, bias=False, init_std=out_std,
                                     seed=seed_for(seed, "fc2"), **kw)


class ParallelMoE(nn.Module):
    """Top-k routed experts (Mixtral's router: softmax, top-k, renormalized), tp-split."""

    def __init__(self, hidden: int, ffn: int, group: CommGroup, *, num_experts: int,
                 top_k: int = 2, activation: str = "swiglu", sequence_parallel: bool = False,
                 init_std: float = 0.02, out_std: float | None = None, seed: int = 0,
                 device=None, dtype=None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} is not in 1..num_experts={num_experts}")
        self.group, self.top_k, self.activation = group, top_k, activation
        self.sequence_parallel = sequence_parallel
        kw = dict(device=device, dtype=dtype)
        self.router = nn.Linear(hidden, num_experts, bias=False, **kw)
        tag(self.router.weight, None)
        setattr(self.router.weight, SP_TAG, True)  # partial gradient per tp rank: summed
        if not self.router.weight.is_meta:
            with torch.no_grad():
                self.router.weight.copy_(master_normal((num_experts, hidden), init_std,
                                                       seed_for(seed, "router")))
        self.experts = nn.ModuleList(
            Expert(hidden, ffn, group, activation, seed_for(seed, f"experts.{e}"), init_std,
                   out_std or init_std, kw) for e in range(num_experts))

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
        out = torch.zeros_like(flat)  # [n, h], this rank's partial sum
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)  # the tokens routed to e
            if token.numel() == 0:
                continue
            y = activate(F.linear(flat[token], expert.fc1.weight), self.activation)  # [n_e, f/tp]
            y = F.linear(y, expert.fc2.weight)  # [n_e, h], partial over tp
            out = out.index_add(0, token, y * weights[token, slot, None].to(y.dtype))
        out = out.view(b, s, h)
        if self.sequence_parallel:
            return ops.reduce_scatter_to_sp(out, self.group)  # [b, s/tp, h]
        return ops.reduce_from_tp(out, self.group)  # [b, s, h]
