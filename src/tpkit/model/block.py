"""One transformer layer (pre-norm GPT/Llama, or post-norm BERT), tensor-parallel.

    x --norm--> attention (heads split) --g--> dropout --+--> norm --> MLP --g--> dropout --+-->
    |____________________________________________________|  |_____________________________|

Per micro-batch it sends exactly 2 all-reduces of b*s*h forward and 2 backward
(with sequence parallelism: 2 all-gathers + 2 reduce-scatters each way).

GPT-NeoX's parallel residual reads both branches off the same x:
    x + attention(norm1(x)) + MLP(norm2(x))          (the same two all-reduces)
A mixture-of-experts MLP (`num_experts > 0`) sends what the dense MLP sends.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm.group import CommGroup
from tpkit.layers.attention import KVSlots, ParallelAttention
from tpkit.layers.experts import ParallelMoE
from tpkit.layers.mlp import ParallelMLP
from tpkit.layers.norm import Norm
from tpkit.layers.random import TPRandom, dropout
from tpkit.model.names import layer
from tpkit.sharding import seed_for
from tpkit.spec.config import ModelConfig


class Block(nn.Module):
    """Norm + ParallelAttention + Norm + ParallelMLP with residuals."""

    def __init__(self, config: ModelConfig, group: CommGroup, *, layer_index: int,
                 sequence_parallel: bool = False, seed: int = 0, expert_parallel: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        c, sp = config, sequence_parallel
        out_std = c.init_std / (2 * c.num_layers) ** 0.5  # GPT-2's scaled residual init
        kw = dict(device=device, dtype=dtype)
        self.pre_norm, self.parallel_residual = c.pre_norm, c.parallel_residual
        self.sequence_parallel, self.p = sp, c.dropout
        norm = dict(kind=c.norm, eps=c.norm_eps, sequence_parallel=sp, offset=c.norm_offset, **kw)
        self.attn_norm = Norm(c.hidden, **norm)
        self.attn = ParallelAttention(
            c.hidden, c.num_heads, group, num_kv_heads=c.kv_heads, bias=c.bias, causal=c.causal,
            rope_theta=c.rope_theta if c.position == "rope" else None, dropout=c.dropout,
            sequence_parallel=sp, init_std=c.init_std, out_std=out_std,
            seed=seed_for(seed, f"{layer(layer_index)}.attn"), head_dim=c.head_dim,
            qkv_bias=c.attn_bias, qk_norm_eps=c.norm_eps if c.qk_norm else None,
            rotary_dim=c.rope_dim, sliding_window=c.sliding_window, rope_llama3=c.rope_llama3,
            **kw)
        self.mlp_norm = Norm(c.hidden, **norm)
        self.mlp = _mlp(c, group, sp, out_std, seed_for(seed, f"{layer(layer_index)}.mlp"), kw,
                        expert_parallel)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rng: TPRandom | None = None, kv_cache: KVSlots | None = None) -> torch.Tensor:
        """x [b, s, h] ([b, s/tp, h] with SP) -> same shape."""
        sharded = self.sequence_parallel  # residual stream split over tp only with SP
        if self.parallel_residual:
            a = self.attn(self.attn_norm(x), attention_mask, rng, kv_cache)
            m = self.mlp(self.mlp_norm(x))
            return x + dropout(a, self.p, self.training, rng, sharded) + \
                dropout(m, self.p, self.training, rng, sharded)
        if self.pre_norm:
            a = self.attn(self.attn_norm(x), attention_mask, rng, kv_cache)
            x = x + dropout(a, self.p, self.training, rng, sharded)
            m = self.mlp(self.mlp_norm(x))
            return x + dropout(m, self.p, self.training, rng, sharded)
        a = self.attn(x, attention_mask, rng, kv_cache)
        x = self.attn_norm(x + dropout(a, self.p, self.training, rng, sharded))
        m = self.mlp(x)
        return self.mlp_norm(x + dropout(m, self.p, self.training, rng, sharded))


def _mlp(c: ModelConfig, group: CommGroup, sp: bool, out_std: float, seed: int, kw: dict,
         expert_parallel: bool) -> nn.Module:
    """The dense Megatron MLP, or top-k routed experts when `num_experts > 0`."""
    if c.num_experts:
        return ParallelMoE(c.hidden, c.ffn, group, num_experts=c.num_experts,
                           top_k=c.experts_per_token, activation=c.activation,
                           sequence_parallel=sp, expert_parallel=expert_parallel,
                           init_std=c.init_std, out_std=out_std, seed=seed, **kw)
    return ParallelMLP(c.hidden, c.ffn, group, activation=c.activation, bias=c.bias,
                       sequence_parallel=sp, init_std=c.init_std, out_std=out_std, seed=seed,
                       **kw)
