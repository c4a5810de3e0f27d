"""A paged KV cache (Kwon et al. 2023, vLLM's PagedAttention, on the CPU): keys and values
live in fixed-size blocks of `block_size` tokens, a sequence holds a table of blocks,
and one forward computes any mix of sequences, each its own number of new tokens.

    cache = PagedCache(model, block_size=16)           # no block yet: it grows on demand
    cache.grow(64)                                     # 64 blocks on every layer
    logits = forward(model, cache, [Piece([5, 17, 200], start=0, blocks=[1], logits=LAST),
                                    Piece([42], start=9, blocks=[2], logits=LAST)])

Each rank holds its own heads' keys and values only (split over tp like the qkv weights;
9 heads at tp=2: 5 + 4), so a block costs 1/tp of the model's on each rank, and every
rank holds the same block numbers. Block 0 is never handed out: a padding row (the
batch-invariant mode's fixed shapes) writes there and reads only itself.

A forward's tokens are rows of their own, ids [T, 1] at positions [T] (each sequence's
rows consecutive): every product of the model is then one [T, h] product, a decode's row
next to a piece of a prompt (chunked prefill). Attention runs per sequence over its own
keys (`decode.attend.PagedBatch`): a sequence's result depends on its tokens and on
which rows share the forward only through the shape of the products, so a forward of a
fixed shape gives a sequence the same bits whatever the other rows hold.

The logits: rows asked for (`Piece.logits`): LAST, the row of a piece's last token;
EVERY, each row's (an echoed prompt's own log-probabilities; the last row is computed
as with LAST, in the same product). Full logits [m, V] float32 gathered over tp, or
(`greedy`) each row's greedy token and its log-probability, [m, 2], from the
vocab-parallel shards: per row each rank sends (its largest logit, that token, the
log-sum-exp of its shard), [m, 3] float32 instead of [m, V/tp]; the token is the first
largest over the ranks (so torch's argmax of the whole row, bit for bit), its
log-probability max - logsumexp(ranks') (`decode_ops.shard_best` and `pick`, at tp=1
too). A grammar (structured outputs) masks each rank's own shard the same way: the
rows' bitmasks over the whole vocabulary (`allowed`), the same on every rank, limit
each shard's largest to its allowed tokens, its log-sum-exp kept (the token's
log-probability stays the model's). A greedy forward of decode rows alone runs whole in
one native call where the model allows it (`decode.stacks.greedy_ready`: the same
kernels, the same bits, the mask included).

The cache's dtype is the model's (bfloat16 weights: a bfloat16 cache); the logits
returned are float32 whatever the dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn

from tpkit.comm import all_gather
from tpkit.decode import stacks
from tpkit.decode.attend import PagedBatch, attend_paged
from tpkit.decode.native import layer_plan
from tpkit.kernels import decode_ops
from tpkit.kernels.paged_attention import decode_plan
from tpkit.spec.errors import UserError

NONE, LAST, EVERY = 0, 1, 2  # which logits a piece asks for
PP_ERROR = ("generate runs at pp=1: one sequence's tokens come one at a time, so a "
            "pipeline would keep all but one stage idle; every tpkit checkpoint loads at "
            "pp=1 (split the model's memory with tp instead)")


@dataclass
class PagedKV:
    """One layer's paged keys and values, k, v [blocks * block_size, kv_local, hd] (flat
    over the blocks), as one forward (`batch`) sees them: what the layer's modules are
    handed as their `kv_cache`."""

    k: torch.Tensor
    v: torch.Tensor
    batch: PagedBatch

    def attend(self, at, qkv: torch.Tensor) -> torch.Tensor:
        """A `ParallelAttention`'s qkv product [T, 1, (nq + 2 kv_local) hd] -> its rows'
        attention [T, 1, nq hd] over this cache (`attend.attend_paged`)."""
        T, s, _ = qkv.shape
        y = attend_paged(at, qkv.view(T, -1, at.head_dim), self)  # [T, nq, hd]
        return y.view(T, s, -1)

    def native(self, block, x: torch.Tensor) -> torch.Tensor | None:
        """A `Block`'s rows x [T, 1, h] on its native plan (`native.layer_plan`), or None
        where it has none (the block's modules run)."""
        plan = layer_plan(block) if decode_ops.fits(x) else None
        return None if plan is None else plan(x, self)


@dataclass
class Piece:
    """The tokens of one sequence computed in a forward: `tokens` at positions start..,
    written into `blocks` (its block table, covering start + len(tokens) tokens)."""

    tokens: list[int]
    start: int
    blocks: list[int]
    logits: int = LAST
    adapter: int = 0  # the served LoRA adapter of its rows (0: the base; `serve.adapters`)
    extra: dict = field(default_factory=dict, compare=False, repr=False)  # rank 0's notes


class PagedCache:
    """Every layer's blocks on this rank: k, v [blocks, block_size, kv_local, hd]."""

    def __init__(self, model: nn.Module, block_size: int = 16,
                 dtype: torch.dtype | None = None) -> None:
        first = next(model.parameters())
        self.dtype, self.device = dtype or first.dtype, first.device
        self.block_size = block_size
        self.shapes = [(layer.attn.local_kv, layer.attn.head_dim)
                       for layer in model.layers.values()]
        self.blocks = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.grow(1)  # block 0: the padding rows' scratch
        self.moving: _Moving | None = None  # the last greedy native step (`ready`)

    @staticmethod
    def block_bytes(model: nn.Module, block_size: int, dtype: torch.dtype | None = None) -> int:
        """Bytes of one block on this rank (keys and values of every layer)."""
        el = (dtype or next(model.parameters()).dtype).itemsize
        return sum(2 * block_size * layer.attn.local_kv * layer.attn.head_dim * el
                   for layer in model.layers.values())

    def grow(self, blocks: int) -> None:
        """Hold at least `blocks` blocks (the old ones kept; every rank grows alike)."""
        if blocks <= self.blocks:
            return
        new = []
        for i, (kv, hd) in enumerate(self.shapes):
            pair = []
            for old in (self.k, self.v):
                t = torch.zeros(blocks * self.block_size, kv, hd, dtype=self.dtype,
                                device=self.device)
                if old:
                    t[:old[i].shape[0]] = old[i]
                pair.append(t)
            new.append(pair)
        self.k, self.v = [p[0] for p in new], [p[1] for p in new]
        self.blocks = blocks

    def nbytes(self) -> int:
        """Bytes of keys and values this rank holds now."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def layout(pieces: list[Piece], block_size: int, window: int | None, rope_len: int,
           device) -> tuple[torch.Tensor, PagedBatch]:
    """ids [T, 1] and the `PagedBatch` of a forward of `pieces` (Python integers until one
    tensor each: a decode row's ~10 small torch ops were ~60 us of a token)."""
    ids, pos, write, seqs, decodes, row = [], [], [], [], [], 0
    for p in pieces:
        n, end = len(p.tokens), p.start + len(p.tokens)
        lo = max(0, p.start - window + 1) if window else 0
        b0 = lo // block_size
        used = p.blocks[b0:-(-end // block_size)]
        if all(b == a + 1 for a, b in zip(used, used[1:])):  # adjacent blocks:
            first = used[0] * block_size - b0 * block_size  # a view of the cache, no
            keys = slice(first + lo, first + end)  # gather (the same layout, same bits)
        else:  # its blocks, gathered whole (`layers.attention._paged`)
            keys = (torch.tensor(used, dtype=torch.long, device=device),
                    slice(lo - b0 * block_size, end - b0 * block_size))
        mask = None
        if n > 1 or window:
            j, q = torch.arange(lo, end), torch.arange(p.start, end)[:, None]
            mask = (j <= q) & (j > q - window) if window else j <= q  # [n, L]
            mask = mask.to(device)
        ids += p.tokens
        pos += range(p.start, end)
        write += [p.blocks[t // block_size] * block_size + t % block_size
                  for t in range(p.start, end)]
        seqs.append((row, n, keys, mask))
        if n == 1:  # a decode row: the kernel reads keys lo..end through its table
            decodes.append((row, p.blocks, lo, end))
        row += n
    longs = torch.tensor([pos, write, ids], dtype=torch.long).to(device)  # [3, T]
    batch = PagedBatch(longs[0], longs[1], seqs, rope_len, block_size,
                       decode=decode_plan(decodes, block_size, device))
    return longs[2][:, None], batch


@torch.no_grad()
def forward(model: nn.Module, cache: PagedCache, pieces: list[Piece], greedy: bool = False,
            allowed: torch.Tensor | None = None
            ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Compute `pieces` in one forward; (logits of the LAST and EVERY pieces' last rows,
    [m, V] float32 in the pieces' order, or [m, 2] `greedy`; None if none asked for,
    [the other rows' logits [n-1, V] of each EVERY piece]). `allowed` (greedy): the m
    rows' grammar bitmasks, int32 [m, words] (`decode_ops.shard_best`), or None."""
    return ready(model, cache, pieces, greedy)(allowed)


def ready(model: nn.Module, cache: PagedCache, pieces: list[Piece], greedy: bool = False
          ) -> Callable[..., tuple[torch.Tensor | None, list[torch.Tensor]]]:
    """`forward` up to the model's first kernel and collective: the function that runs
    the rest, given `forward`'s `allowed` (the layout made; a greedy decode's native call readied: a follower readies
    the step it expects while rank 0 plans it, `tpkit.serve.runner`). Until it runs, the
    cache must not grow and no other forward run or be readied on it (a greedy step of
    decode rows is moved on in the same buffers: `_moved`)."""
    _check(model)
    c = model.config
    adapted = any(p.adapter for p in pieces)  # their layers one by one (`serve.adapters`)
    decodes = greedy and not adapted and all(len(p.tokens) == 1 and p.logits == LAST
                                             for p in pieces)
    if decodes and (run := _moved(cache, pieces, c.sliding_window)) is not None:
        return run
    cache.moving = None
    _check_tables(pieces, cache)
    ids, batch = layout(pieces, cache.block_size, c.sliding_window, c.max_seq_len,
                        cache.device)
    batch.adapted = adapted
    caches = [PagedKV(k, v, batch) for k, v in zip(cache.k, cache.v)]
    if decodes:
        native = stacks.greedy_ready(model, ids, caches)  # one native call, or None
        if native is not None:
            def run(allowed=None):  # a copy: the call's buffers serve the next step too
                return native(allowed).clone(), []
            cache.moving = _Moving([list(p.blocks) for p in pieces], batch.positions.numpy(),
                                   batch.write.numpy(), ids.numpy()[:, 0],
                                   batch.decode.meta.numpy(), run, native.still, cache.k[0])
            return run
    return partial(_modules, model, ids, batch, caches, pieces, greedy)


@dataclass
class _Moving:
    """A greedy step of decode rows on the native call, readied, kept to be moved on:
    the next step of as many rows on the same block tables (each its next token) changes
    only its positions, cache slots, ids and each row's key range, written in place
    (`_moved`: the layout, the call's arguments and its buffers made once, not per token;
    ~0.4 ms of a GPT-2 token in Python, on caches the weights just flushed)."""

    tables: list[list[int]]  # each row's block table as `meta` holds it: copies (a
    # caller may grow its list in place, as `serve.draft` does, after the call is planned)
    positions: np.ndarray  # [T] views of the tensors the call reads (no copies)
    slots: np.ndarray  # [T] each row's flat cache position
    ids: np.ndarray  # [T]
    meta: np.ndarray  # the attention's rows: [row, table at, lo, end] each, then tables
    run: Callable
    still: Callable[[], bool]  # whether the native call still points at these buffers
    k: torch.Tensor  # the cache's first k tensor (a new one: it grew)


def _moved(cache: PagedCache, pieces: list[Piece], window: int | None) -> Callable | None:
    """`cache.moving`'s step for `pieces` (decode rows), its tensors rewritten in place,
    or None where it is not that step (`_Moving`)."""
    last = cache.moving
    if last is None or last.k is not cache.k[0] or len(pieces) != len(last.tables) or \
            not last.still() or any(p.blocks != t for p, t in zip(pieces, last.tables)):
        return None  # (a table grown since: the kernel would read past the one it holds)
    bs, T = cache.block_size, len(pieces)
    starts = [p.start for p in pieces]
    if any(s >= len(p.blocks) * bs for s, p in zip(starts, pieces)):
        return None  # (the layout names that error)
    last.positions[:] = starts  # in `layout`'s row order; each row's key range lo .. end
    last.slots[:] = [p.blocks[s // bs] * bs + s % bs for s, p in zip(starts, pieces)]
    last.ids[:] = [p.tokens[0] for p in pieces]
    head = last.meta[:4 * T].reshape(T, 4)  # a view
    head[:, 2] = [max(0, s - window + 1) if window else 0 for s in starts]
    head[:, 3] = [s + 1 for s in starts]
    return last.run


@torch.no_grad()
def _modules(model: nn.Module, ids: torch.Tensor, batch: PagedBatch, caches: list[PagedKV],
             pieces: list[Piece], greedy: bool, allowed: torch.Tensor | None = None
             ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """`forward` on the model's modules."""
    h = _body(model, ids, caches, batch.positions)  # [T, 1, h]
    lasts = [first + n - 1 for (first, n, _, _), p in zip(batch.seqs, pieces) if p.logits]
    every = [(first, n) for (first, n, _, _), p in zip(batch.seqs, pieces)
             if p.logits == EVERY]
    rest = [_full(model, h[first:first + n - 1]) for first, n in every]
    if not lasts:
        return None, rest
    last = h[torch.tensor(lasts, device=h.device)]  # [m, 1, h]
    return (_greedy(model, last, allowed) if greedy else _full(model, last)), rest


def _body(model: nn.Module, ids: torch.Tensor, caches: list[PagedKV], positions: torch.Tensor
          ) -> torch.Tensor:
    """ids [T, 1] -> final hidden [T, 1, h]: the embedding at the rows' positions, the
    layers (in one native call where `stacks.stack` takes the rows, else each layer's
    modules, handed its cache), the final norm."""
    with model._sequence(ids, None):
        x = model._embed(ids, None, positions)
        layers = stacks.stack(model) if not model.training else None
        if layers is not None and layers.takes(x.shape[0], x.dtype, caches):
            x = layers(x, caches)
        else:
            for (i, layer), cache in zip(model.layers.items(), caches):
                with model.mesh.ledger.scope(f"layers.{i}"):
                    x = layer(x, None, model.rng, cache)
        return model.final_norm(x) if model.final_norm is not None else x


def _full(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Hidden rows [m, 1, h] -> full logits [m, V] float32, gathered over tp."""
    V = model.config.vocab_size
    if h.shape[0] == 0:
        return torch.zeros(0, V)
    return all_gather(model.logits(h)[:, 0], model.group, dim=-1)[:, :V].float()


def _check(model: nn.Module) -> None:
    if not (model.is_first_stage and model.is_last_stage):
        raise UserError(PP_ERROR)


def _check_tables(pieces: list[Piece], cache: PagedCache) -> None:
    """ValueError unless every piece's block table covers its tokens with blocks of the
    cache: the native kernels read and write through the tables unchecked."""
    for i, p in enumerate(pieces):
        end = p.start + len(p.tokens)
        if p.blocks and (min(p.blocks) < 0 or max(p.blocks) >= cache.blocks):
            bad = next(b for b in p.blocks if not 0 <= b < cache.blocks)
            raise ValueError(f"paged forward: piece {i}'s block table names block {bad}, "
                             f"outside the cache's {cache.blocks} blocks")
        if end > len(p.blocks) * cache.block_size:
            raise ValueError(f"paged forward: piece {i}'s {len(p.blocks)} blocks of "
                             f"{cache.block_size} hold {len(p.blocks) * cache.block_size} "
                             f"tokens, not its {end}")


def _greedy(model: nn.Module, h: torch.Tensor, allowed: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Final hidden [b, 1, h] -> [b, 2] float32 (greedy token, its log-probability) from
    each rank's shard of the logits (masked by `allowed`), gathering [b, 3] per rank
    (module docstring)."""
    local = model.logits(h)[:, 0]  # [b, V_pad/tp]
    first = model.group.rank * local.shape[-1]  # the shard's first token id
    return _pick(model, decode_ops.shard_best(local, first, model.config.vocab_size,
                                              allowed))


def _pick(model: nn.Module, mine: torch.Tensor) -> torch.Tensor:
    """Each rank's best of its shard [b, 3] (value, token, log-sum-exp:
    `decode_ops.shard_best`) -> [b, 2] (greedy token, its log-probability), over the
    ranks (`decode_ops.pick`)."""
    tp = model.group.size
    every = mine if tp == 1 else all_gather(mine, model.group, dim=0)  # [tp * b, 3]
    return decode_ops.pick(every, tp)
