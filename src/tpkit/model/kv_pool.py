"""A KV cache preallocated once for a fixed number of sequences (slots), and the two
forwards of generation over it: the prefill of one sequence and the decode of all.

    pool = KVPool(model, slots=8, max_len=512)   # per layer k, v [8, kv_local, 512, hd]
    logits = prefill(model, pool, slot=3, ids=[5, 17, 200])   # [V]: after the last token
    logits = decode(model, pool, tokens, lengths)             # [8, V]: a token per busy slot

Each rank holds its own heads' keys and values only (split over tp like the qkv
weights; shared kv heads when kv_heads < tp), so the pool costs 1/tp of the
model's cache on each rank. Nothing grows or moves while generating: a forward writes
its new keys in place (`layers.attention.KVSlots`) and each slot has its own length
and positions (0, 1, ... from its own first token: no padding).

Two ways to decode (`chunk`):
- None (the default: fastest at every load): one forward of the slots that are busy,
  [n, 1] for n running sequences (their slots need not be adjacent), so one client
  pays for one row. A matrix product's rounding depends on its shape (on the CPU a
  1-row product takes another kernel than an 8-row one), so a sequence's logits may
  differ in the last bits with what else runs.
- C (batch invariant, exact): the shapes never depend on what else is running. A
  decode runs every slot of each chunk of C slots ([C, 1]: the free ones compute a
  dummy token at position 0 that nobody reads; a chunk with no busy slot is skipped),
  and each row attends over its own cached keys only, row by row
  (`layers.attention`). A sequence's logits are then bit for bit the same whatever
  shares the pool, for a given (slots, chunk), and whatever `max_len`.
Either way a prefill is one sequence alone ([1, s]).

The pool's dtype is the model's (bfloat16 weights: a bfloat16 cache); the logits
returned are float32 whatever the dtype (the head's product stays in the model's
dtype, the softmax and sampling that follow read float32).

Two tensor-parallel collectives per layer (the two all-reduces) plus one all-gather of
the last logits per forward; every rank returns the same logits. A greedy decode
(`decode(..., greedy=True)`) gathers each rank's best instead of its logits: per row
(its largest logit, that token, the log-sum-exp of its shard), [b, 3] float32 from each
rank instead of [b, V/tp]; the token is the first largest over the ranks (so torch's
argmax of the whole row, bit for bit), its log-probability max - logsumexp(ranks').
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm import all_gather
from tpkit.layers.attention import KVSlots
from tpkit.spec.errors import UserError


class KVPool:
    """Keys and values of `slots` sequences of up to `max_len` tokens, for every layer."""

    def __init__(self, model: nn.Module, slots: int, max_len: int,
                 dtype: torch.dtype | None = None, chunk: int | None = None) -> None:
        if slots < 1 or max_len < 1 or (chunk is not None and chunk < 1):
            raise UserError(f"a KV pool needs slots, max_len and chunk >= 1 (got slots={slots}, "
                            f"max_len={max_len}, chunk={chunk})")
        if max_len > model.config.max_seq_len:
            raise UserError(f"max_len={max_len} exceeds the model's max_seq_len="
                            f"{model.config.max_seq_len}")
        first = next(model.parameters())
        dtype, device = dtype or first.dtype, first.device
        self.slots, self.max_len = slots, max_len
        self.chunk = None if chunk is None else min(chunk, slots)  # None: the busy slots
        self.k, self.v = [], []
        for layer in model.layers.values():
            a = layer.attn  # this rank's kv heads only
            shape = (slots, a.local_kv, max_len, a.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))

    def views(self, first: int, count: int, starts: torch.Tensor) -> list[KVSlots]:
        """Slots first..first+count-1 as one forward's per-layer caches (views, no copy)."""
        return [KVSlots(k[first:first + count], v[first:first + count], starts)
                for k, v in zip(self.k, self.v)]

    def rows(self, slots: torch.Tensor, starts: torch.Tensor) -> list[KVSlots]:
        """Slots `slots` [n] (any, in any order) as one forward's per-layer caches."""
        return [KVSlots(k, v, starts, slots) for k, v in zip(self.k, self.v)]

    def nbytes(self) -> int:
        """Bytes of keys and values this rank holds."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


PP_ERROR = ("generate runs at pp=1: one sequence's tokens come one at a time, so a "
            "pipeline would keep all but one stage idle; every tpkit checkpoint loads at "
            "pp=1 (split the model's memory with tp instead)")


def _check(model: nn.Module) -> None:
    if not (model.is_first_stage and model.is_last_stage):
        raise UserError(PP_ERROR)


def _greedy(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Final hidden [b, 1, h] -> [b, 2] float32 (greedy token, its log-probability) from
    each rank's shard of the logits, gathering [b, 3] per rank (module docstring)."""
    local = model.logits(h)[:, 0].float()  # [b, V_pad/tp]
    n, tp, V = local.shape[-1], model.group.size, model.config.vocab_size
    first = model.group.rank * n  # the shard's first token id
    pad = torch.arange(first, first + n, device=local.device) >= V  # vocabulary padding
    local = local.masked_fill(pad, float("-inf"))
    best, idx = local.max(-1)  # [b]: the first largest of the shard
    mine = torch.stack([best, (idx + first).to(best.dtype), local.logsumexp(-1)], -1)
    every = all_gather(mine, model.group, dim=-1).view(-1, tp, 3)  # [b, tp, 3]
    vals = every[..., 0]
    win = (vals == vals.max(-1, keepdim=True).values).to(torch.int8).argmax(-1)  # first rank
    rows = torch.arange(vals.shape[0], device=vals.device)
    top = every[rows, win]  # [b, 3]
    return torch.stack([top[:, 1], top[:, 0] - every[..., 2].logsumexp(-1)], -1)  # [b, 2]


@torch.no_grad()
def _last_logits(model: nn.Module, ids: torch.Tensor, caches: list[KVSlots],
                 starts: torch.Tensor, every: bool = False, greedy: bool = False
                 ) -> torch.Tensor:
    """ids [b, s] through the model with `caches` -> full logits [b, V] of the last token
    (`every`: [b, s, V], of every position; the last one computed as without `every`;
    `greedy`: [b, 2], its greedy token and log-probability, `_greedy`)."""
    h = model.body(ids, kv_caches=caches, position_offset=starts)  # [b, s, h]
    if greedy:
        return _greedy(model, h[:, -1:])
    V = model.config.vocab_size
    last = all_gather(model.logits(h[:, -1:])[:, 0], model.group, dim=-1)[:, :V].float()
    if not every:
        return last  # [b, V] float32
    if h.shape[1] == 1:
        return last[:, None]
    rest = all_gather(model.logits(h[:, :-1]), model.group, dim=-1)[..., :V].float()
    return torch.cat([rest, last[:, None]], dim=1)  # [b, s, V]


def prefill(model: nn.Module, pool: KVPool, slot: int, ids: list[int] | torch.Tensor,
            every: bool = False) -> torch.Tensor:
    """Cache sequence `ids` in `slot` (positions 0..s-1); the logits [V] after it (`every`:
    [s, V], after each of its tokens: the prompt's own log-probabilities, for `echo`; the
    last row is bit for bit the one without `every`)."""
    _check(model)
    ids = torch.as_tensor(ids, device=pool.k[0].device).reshape(1, -1)  # [1, s]
    if not 0 < ids.shape[1] <= pool.max_len:
        raise UserError(f"a prompt of {ids.shape[1]} tokens does not fit a slot of "
                        f"{pool.max_len}")
    starts = torch.zeros(1, dtype=torch.long, device=ids.device)
    return _last_logits(model, ids, pool.views(slot, 1, starts), starts, every)[0]


def decode(model: nn.Module, pool: KVPool, tokens: torch.Tensor, lengths: torch.Tensor,
           greedy: bool = False) -> torch.Tensor:
    """One token per busy slot: `tokens` [slots] (-1 for a free slot) at positions
    `lengths` [slots] (each slot's cached length) -> logits [slots, V] (rows of free
    slots: zeros or a dummy's; `greedy`: [slots, 2], each slot's greedy token and its
    log-probability, gathered from the shards). The busy slots in one forward, or
    (`pool.chunk`) every slot of each chunk holding a busy one."""
    _check(model)
    device = pool.k[0].device
    tokens, lengths = tokens.to(device).reshape(-1), lengths.to(device).reshape(-1)
    busy = (tokens >= 0).nonzero()[:, 0]  # [n]
    assert busy.numel(), "decode with no busy slot"
    if pool.chunk is None:
        logits = _last_logits(model, tokens[busy][:, None], pool.rows(busy, lengths[busy]),
                              lengths[busy], greedy=greedy)  # [n, V] (greedy: [n, 2])
        out = logits.new_zeros(pool.slots, logits.shape[1])
        out[busy] = logits
        return out
    out = None
    for first in range(0, pool.slots, pool.chunk):
        rows = slice(first, min(first + pool.chunk, pool.slots))
        if not bool((tokens[rows] >= 0).any()):
            continue  # nobody here: skipped (the shapes of the others do not change)
        ids = tokens[rows].clamp(min=0)[:, None]  # [chunk, 1]
        logits = _last_logits(model, ids, pool.views(first, ids.shape[0], lengths[rows]),
                              lengths[rows], greedy=greedy)  # [chunk, V] (greedy: [chunk, 2])
        if out is None:
            out = logits.new_zeros(pool.slots, logits.shape[1])
        out[rows] = logits
    return out
