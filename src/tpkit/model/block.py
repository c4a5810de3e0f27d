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
from tpkit.comm.ops import reduce_from_tp
from tpkit.layers import decode_ops
from tpkit.layers.attention import PagedKV, ParallelAttention
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
        self._native = None  # the decode rows' native plan (`native_decode`), or False

    def native_decode(self) -> _NativeLayer | None:
        """This layer's decode rows on `layers.decode_ops` alone (`_NativeLayer`), or None:
        a pre-norm dense layer whose norms and linear weights are all native decode-only
        ones (`layers.quant.for_decode` with the library), not training, no SP, no cp.
        Decided at the first decode (the weights do not change after `for_decode`)."""
        if self._native is None:
            self._native = _NativeLayer.of(self) or False
        return self._native or None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rng: TPRandom | None = None, kv_cache: PagedKV | None = None) -> torch.Tensor:
        """x [b, s, h] ([b, s/tp, h] with SP) -> same shape."""
        if kv_cache is not None and decode_ops.fits(x) and self.native_decode():
            return self._native(x, kv_cache)
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



class _NativeLayer:
    """A decode-only pre-norm dense layer's decode rows x [T, 1, h] (T <= decode_ops.ROWS)
    on the native kernels alone, the modules' tensors and kernels looked up once (a
    module attribute costs ~1 us, a module call ~3: ~15 a layer, 30 layers a token):

        h = norm(x); x = x + out(attention(qkv(h))); h = norm(x); x = x + fc2(act(fc1(h)))

    at tp=1 each residual and bias added inside the product's call; at tp > 1 the
    partial products all-reduced first, then the bias and the residual (the same sums
    as `Block.forward`, in its order)."""

    def __init__(self, b: Block) -> None:
        at, mlp = b.attn, b.mlp
        self.norms = [(n.weight, n.bias, n.eps, n.offset) for n in (b.attn_norm, b.mlp_norm)]
        self.qkv, self.qkv_bias = at.qkv.decoding.rows, at.qkv.bias
        self.out, self.out_bias = at.out.decoding.rows, at.out.bias
        self.fc1, self.fc1_bias = mlp.fc1.decoding.rows, mlp.fc1.bias
        self.fc2, self.fc2_bias = mlp.fc2.decoding.rows, mlp.fc2.bias
        self.gated, self.act = mlp.activation == "swiglu", mlp.act
        self.attend, self.hd, self.group = at._attend_paged, at.head_dim, at.group

    @classmethod
    def of(cls, b: Block) -> _NativeLayer | None:
        at, mlp = b.attn, b.mlp
        if not (b.pre_norm and not b.parallel_residual and not b.training
                and not b.sequence_parallel and isinstance(mlp, ParallelMLP)
                and b.attn_norm.native and b.mlp_norm.native
                and (at.cp is None or at.cp.size == 1)):
            return None
        if any(getattr(m.decoding, "rows", None) is None
               for m in (at.qkv, at.out, mlp.fc1, mlp.fc2)):
            return None
        return cls(b)

    def _reduce(self, y, bias, residual):
        if self.group.size == 1:
            return y
        y = reduce_from_tp(y, self.group)  # [T, 1, h], the partial products summed
        return residual + (y + bias if bias is not None else y)

    def __call__(self, x: torch.Tensor, cache: PagedKV) -> torch.Tensor:
        T, one = x.shape[0], self.group.size == 1
        h = decode_ops.norm(x, *self.norms[0])
        y = self.attend(self.qkv(h, self.qkv_bias).view(T, -1, self.hd), cache)  # [T, nq, hd]
        y = y.view(T, 1, -1)
        x = self._reduce(self.out(y, self.out_bias, x) if one else self.out(y),
                         self.out_bias, x)
        h = decode_ops.norm(x, *self.norms[1])
        a = self.fc1.gated(h, self.fc1_bias) if self.gated else self.act(self.fc1(h, self.fc1_bias))
        return self._reduce(self.fc2(a, self.fc2_bias, x) if one else self.fc2(a),
                            self.fc2_bias, x)
