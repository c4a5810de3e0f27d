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
from tpkit.layers import lora
from tpkit.layers.attention import ParallelAttention
from tpkit.layers.experts import ParallelMoE
from tpkit.layers.mlp import ParallelMLP
from tpkit.layers.norm import Norm
from tpkit.layers.random import TPRandom, dropout
from tpkit.layers.sharding import seed_for
from tpkit.model.names import layer
from tpkit.spec.config import ModelConfig


class Block(nn.Module):
    """Norm + ParallelAttention + Norm + ParallelMLP with residuals."""

    def __init__(self, config: ModelConfig, group: CommGroup, *, layer_index: int,
                 sequence_parallel: bool = False, seed: int = 0, expert_parallel: bool = False,
                 cp: CommGroup | None = None, device=None, dtype=None) -> None:
        super().__init__()
        c, sp = config, sequence_parallel
        out_std = c.init_std / (2 * c.num_layers) ** 0.5  # GPT-2's scaled residual init
        kw = dict(device=device, dtype=dtype)
        self.pre_norm, self.parallel_residual = c.pre_norm, c.parallel_residual
        self.sequence_parallel, self.p = sp, c.dropout
        norm = dict(kind=c.norm, eps=c.norm_eps, sequence_parallel=sp, offset=c.norm_offset, **kw)
        self.attn_norm = Norm(c.hidden, **norm)
        name, own = layer(layer_index), dict(sequence_parallel=sp, out_std=out_std, **kw)
        self.attn = ParallelAttention(c, group, seed=seed_for(seed, f"{name}.attn"), cp=cp,
                                      **own)  # cp: ring attention over that group
        self.mlp_norm = Norm(c.hidden, **norm)
        mlp_seed = seed_for(seed, f"{name}.mlp")
        self.mlp = ParallelMoE.from_config(c, group, expert_parallel=expert_parallel,
                                           seed=mlp_seed, **own) if c.num_experts else \
            ParallelMLP.from_config(c, group, seed=mlp_seed, **own)  # top-k experts, or dense
        if c.lora_rank:  # low-rank adapters on the targeted linears (the model freezes the rest)
            lora.attach(self, c, seed_for(seed, f"{name}.lora"))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rng: TPRandom | None = None, kv_cache=None) -> torch.Tensor:
        """x [b, s, h] ([b, s/tp, h] with SP) -> same shape. `kv_cache`: a decode's
        (`tpkit.decode.paged_kv.PagedKV`), handed to the attention; it runs the whole
        layer natively where it can."""
        if kv_cache is not None and (y := kv_cache.native(self, x)) is not None:
            return y
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
