"""Self-attention split by heads (Shoeybi et al. 2019, section 3; quiz answer 4).

    x [b, s, h] --f--> qkv (column-parallel, fused [q; k; v])
        rank r: its range of q heads (nh/tp, or one more)   -> [b, nq, s, hd]
                kv heads its query heads read (GQA)         -> [b, kv_local, s, hd]
        local scaled-dot-product attention: heads never talk to each other
    --> out (row-parallel) --g--> one all-reduce -> [b, s, h]

Any tp up to the number of heads: the heads are dealt as evenly as possible, the
first ranks one more (9 heads at tp=2: 5 + 4), and the sum over ranks is the same
sum whatever the sizes, so every split is exact (`tpkit.spec.split`).

Grouped-query attention: each rank holds the kv heads its query heads read (a range
of kv groups). When the query ranges do not line up with the groups (kv_heads < tp,
or 9 heads / 3 kv at tp=2: rank 0 reads kv 0-1, rank 1 kv 1-2) a kv head is held by
every rank that reads it and `finalize_tp_grads` sums its gradient over them. MQA
(1 kv head) is the case kv = 1.

Per-family options, all per head (so they commute with the split): a head width
decoupled from hidden / heads (`head_dim`, Qwen3, Gemma), a bias on q, k, v only
(`attn_bias`, Qwen2), RMSNorm over each head's q and k (`qk_norm`, Qwen3: one
weight shared by every head, so each rank's gradient is partial and tagged for the
tp sum), rotary on the first `rope_dim` dims (GPT-NeoX), Llama 3.1's rotary frequency
scaling (`rope_llama3`), a sliding window (Mistral).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.comm.group import CommGroup
from tpkit.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpkit.layers.norm import Norm
from tpkit.layers.random import TPRandom
from tpkit.layers.ring_attention import cp_positions, ring_attention
from tpkit.layers.rotary import apply_rope, rope_angles
from tpkit.layers.sharding import seed_for, set_meta
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import UserError
from tpkit.spec.shapes import even_range, heads_problems, kv_range
from tpkit.spec.split import TPSplit


def heads_of_rank(num_heads: int, kv_heads: int, tp: int, rank: int
                  ) -> tuple[list[int], list[int]]:
    """(query heads, kv heads) that `rank` of `tp` owns."""
    (q0, nq), (k0, nk) = even_range(num_heads, tp, rank), kv_range(num_heads, kv_heads, tp, rank)
    return list(range(q0, q0 + nq)), list(range(k0, k0 + nk))


def kv_index(num_heads: int, kv_heads: int, tp: int, rank: int) -> list[int] | None:
    """For each of `rank`'s query heads, which of its local kv heads it reads; None when
    that is `repeat_interleave(nq / nkv)` (every local kv head serves as many)."""
    q, kv = heads_of_rank(num_heads, kv_heads, tp, rank)
    group = num_heads // kv_heads
    index = [j // group - kv[0] for j in q]
    return None if index == [i // (len(q) // len(kv)) for i in range(len(q))] else index


class ParallelAttention(nn.Module):
    """Multi-head / grouped-query / multi-query self-attention, heads split over tp.

    Built from a model's config: every attention feature of a family is read here, from
    `c` (a layer on its own: `ParallelAttention(ModelConfig(hidden=64, num_heads=4), g)`)."""

    def __init__(self, c: ModelConfig, group: CommGroup, *, sequence_parallel: bool = False,
                 seed: int = 0, out_std: float | None = None, cp: CommGroup | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        tp, kv, hidden, num_heads = group.size, c.kv_heads, c.hidden, c.num_heads
        if "head_dim" in c.derived and hidden % num_heads:
            raise UserError(f"hidden={hidden} is not divisible by num_heads={num_heads}")
        if heads_problems(num_heads, kv, tp):
            raise UserError("; ".join(heads_problems(num_heads, kv, tp)))
        self.hidden, self.num_heads, self.kv_heads, self.group = hidden, num_heads, kv, group
        self.head_dim = hd = c.head_dim
        q_heads, kv_local = heads_of_rank(num_heads, kv, tp, group.rank)
        self.local_heads, self.local_kv = len(q_heads), len(kv_local)
        self.kv_index = kv_index(num_heads, kv, tp, group.rank)  # None: a plain repeat
        self._kv_key = None if self.kv_index is None else tuple(self.kv_index)
        self.causal, self.dropout = c.causal, c.dropout
        self.rope_theta = c.rope_theta if c.position == "rope" else None
        self.rope_dim, self.sliding_window, self.rope_llama3 = (c.rope_dim, c.sliding_window,
                                                                c.rope_llama3)
        self.cp = cp  # context parallel: ring attention over this group (None: off)
        kw = dict(device=device, dtype=dtype)
        self.qkv = ColumnParallelLinear(
            hidden, (num_heads + 2 * kv) * hd, group, bias=c.attn_bias,
            split=TPSplit.heads(num_heads, kv, hd), sequence_parallel=sequence_parallel,
            init_std=c.init_std, seed=seed_for(seed, "qkv"), **kw)
        self.out = RowParallelLinear(num_heads * hd, hidden, group, bias=c.bias, units=num_heads,
                                     sequence_parallel=sequence_parallel,
                                     init_std=out_std or c.init_std, seed=seed_for(seed, "out"),
                                     **kw)
        self.q_norm = self.k_norm = None
        if c.qk_norm:
            self.q_norm, self.k_norm = (Norm(hd, "rmsnorm", c.norm_eps, **kw) for _ in range(2))
            for p in (self.q_norm.weight, self.k_norm.weight):  # one [hd] weight for all heads,
                set_meta(p, sequence_parallel=True)  # each rank's heads: a partial gradient, tp sum

    def owned_heads(self) -> tuple[list[int], list[int]]:
        """(query heads, kv heads) this rank computes."""
        return heads_of_rank(self.num_heads, self.kv_heads, self.group.size, self.group.rank)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                rng: TPRandom | None = None, kv_cache=None) -> torch.Tensor:
        """x [b, s, h] ([b, s/tp, h] with SP) -> same shape; one all-reduce forward.

        `attention_mask` [b, s] is 1 for real tokens and 0 for padding. With `kv_cache`
        (a causal model generating: `tpkit.decode.paged_kv.PagedKV`) the cache attends
        the rows' q, k, v over its keys instead."""
        qkv = self.qkv(x)  # [b, s, (nh/tp + 2 kv_local) hd]
        if kv_cache is not None:  # the decode wing's: rows of one token, [T, 1, ...]
            return self.out(kv_cache.attend(self, qkv))  # [T, 1, h] summed over tp
        b, s, _ = qkv.shape
        hd, nq, nkv = self.head_dim, self.local_heads, self.local_kv
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q = q.view(b, s, nq, hd).transpose(1, 2)  # [b, nh/tp, s, hd]
        k = k.view(b, s, nkv, hd).transpose(1, 2)  # [b, kv_local, s, hd]
        v = v.view(b, s, nkv, hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over each head's hd
        ring = self.cp is not None and self.cp.size > 1  # this rank holds 2 chunks of S
        if self.rope_theta is not None:
            cos, sin = self._angles(s, x.device, ring)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ring:  # keys and values around the cp ring; kv heads travel unrepeated
            if self.kv_index is not None:  # unless the groups are uneven here
                k, v = self.for_queries(k), self.for_queries(v)
            y = ring_attention(q, k, v, self.cp)  # [b, nh/tp, s, hd]
            return self.out(y.transpose(1, 2).reshape(b, s, nq * hd))  # [b, s, h] over tp
        k, v = self.for_queries(k), self.for_queries(v)  # [b, nq, s, hd]
        y = self._attend(q, k, v, attention_mask, rng)  # [b, nh/tp, s, hd]
        y = y.transpose(1, 2).reshape(b, s, nq * hd)  # [b, s, h/tp]
        return self.out(y)  # [b, s, h] summed over tp

    @property
    def ring_heads(self) -> int:
        """Key/value heads this rank sends around a context-parallel ring: its kv heads,
        or one per query head where its query range does not line up with the groups."""
        return self.local_kv if self.kv_index is None else self.local_heads

    def for_queries(self, k: torch.Tensor) -> torch.Tensor:
        """[b, kv_local, t, hd] -> [b, nq, t, hd]: the kv head each local query head reads
        (grouped-query: each kv head serves nq/nkv of them, or, where the query range
        does not line up with the kv groups, its own count)."""
        if self.kv_index is not None:
            return k.index_select(1, torch.tensor(self.kv_index, device=k.device))
        g = self.local_heads // self.local_kv
        return k.repeat_interleave(g, dim=1) if g > 1 else k

    def _angles(self, s: int, device, ring: bool):
        """cos, sin [s, rope_dim] of this rank's positions (global ones under cp)."""
        if not ring:
            return rope_angles(s, self.rope_dim, self.rope_theta, 0, device, self.rope_llama3)
        cos, sin = rope_angles(s * self.cp.size, self.rope_dim, self.rope_theta, 0, device,
                               self.rope_llama3)  # [S, rd]
        pos = cp_positions(s, self.cp, device=device)  # [s] global positions
        return cos[pos], sin[pos]

    def _attend(self, q, k, v, attention_mask, rng):
        s, t = q.shape[2], k.shape[2]
        p = self.dropout if self.training else 0.0
        mask = None
        window = self.sliding_window if self.sliding_window and self.sliding_window < t else None
        if attention_mask is not None or window:
            mask = torch.ones(s, t, dtype=torch.bool, device=q.device)
            if self.causal:
                mask = torch.tril(mask)  # query i sees keys <= i
            if window:
                mask = torch.triu(mask, diagonal=1 - window)  # ... and > i - window
            mask = mask.expand(q.shape[0], 1, s, t)
            if attention_mask is not None:
                mask = mask & attention_mask[:, None, None, -t:].bool()
                mask = mask | ~mask.any(-1, keepdim=True)  # no key (a left pad): all, not NaN
        causal = self.causal and mask is None
        if p and rng is not None:  # the heads are split over tp: per-rank dropout masks
            with rng.fork():
                return F.scaled_dot_product_attention(q, k, v, mask, p, is_causal=causal)
        return F.scaled_dot_product_attention(q, k, v, mask, p, is_causal=causal)
