"""Attention over the paged KV cache: one forward's rows (`PagedBatch`) and what a layer's
`ParallelAttention` does with them when it is handed a cache (`paged_kv.PagedKV.attend`):

    heads [T, nq + 2 kv_local, hd] (each row's q, k, v heads, straight from the qkv product)
      -> q, k normed (qk-norm) and rotated, k and v written into their blocks
      -> each sequence's rows attend over its own keys only -> [T, nq, hd]

The decode rows (one token) in one native call for all of them (`kernels.paged_attention`),
each longer piece in a fused attention of its own on exactly its keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tpkit.kernels import decode_ops, paged_attention
from tpkit.layers.rotary import apply_rope, rope_at


@dataclass
class PagedBatch:
    """One forward's rows over a paged KV cache, shared by every layer
    (`tpkit.decode.paged_kv`). Every token is a row of its own ([T, 1] ids): row t has
    position `positions[t]` and writes its key and value at flat cache position
    `write[t]` (block * block_size + offset). `seqs`: (first row, rows, keys, mask) of
    each sequence: its rows are consecutive, `keys` the L keys they read: a slice of the
    flat cache where its blocks are adjacent, else (its block table [nb], the slice of
    those blocks' nb * block_size positions), gathered a block at a time (a row at a
    time cost ~3x as much: ~100 ms a step at 4k keys for SmolLM2-135M here); `mask`
    [rows, L] (None: every key). `angles`: the rows' rotary cos and sin, read from the
    table once per forward for every layer that rotates alike. `decode`: the rows of
    one token for the native kernel (`kernels.paged_attention`; None: every row on SDPA).
    `native`: whether the rows rotate and write the cache natively (`kernels.decode_ops`),
    decided by the first layer."""

    positions: torch.Tensor
    write: torch.Tensor
    seqs: list[tuple[int, int, slice | tuple[torch.Tensor, slice], torch.Tensor | None]]
    rope_len: int
    block_size: int
    angles: dict = field(default_factory=dict)
    decode: paged_attention.DecodePlan | None = None
    native: bool | None = None  # whether `decode_ops.rope_write` takes them (first layer decides)
    adapted: bool = False  # rows with served LoRA adapters: no one-call stack (`serve.adapters`)


def attend_paged(at, heads: torch.Tensor, cache) -> torch.Tensor:
    """A `ParallelAttention` `at`'s rows over the paged cache `cache` (`paged_kv.PagedKV`):
    heads [T, nq + 2 kv_local, hd] (a row per token, its q, k, v heads) -> [T, nq, hd]:
    q and k normed and rotated together, the keys and values written into their
    blocks, then each sequence's rows attend over its own keys only: the decode rows
    (one token) in one native call for all of them (`kernels.paged_attention`), each
    longer piece in a fused attention of its own on exactly its keys. Either way a
    row's result depends on its own tokens alone, never on the other rows or on how
    full the cache is (batched, the CPU's fused attention would split its work over
    threads by batch row)."""
    batch, nq, nkv, T = cache.batch, at.local_heads, at.local_kv, heads.shape[0]
    qk, v = heads[:, :nq + nkv], heads[:, nq + nkv:]
    if at.q_norm is not None:
        qk = torch.cat([at.q_norm(qk[:, :nq]), at.k_norm(qk[:, nq:])], 1)
    angles = None
    if at.rope_theta is not None:
        angles = paged_angles(batch, (at.rope_dim, at.rope_theta, at.rope_llama3), T)
    native = batch.native
    if native is None:  # decided once per forward: the same tensors' kinds every layer
        native = batch.native = decode_ops.takes(heads, cache.k)
    if native:  # one native call: rotate q and k, write k and v into their blocks
        if at.q_norm is not None:
            heads[:, :nq + nkv] = qk
        decode_ops.rope_write(heads, nq + nkv, nkv, *(angles or (None, None)),
                              batch.write, cache.k, cache.v)
        qk = heads  # q: its first nq heads of every row
    else:
        if angles is not None:
            qk = apply_rope(qk, *angles)  # q and k heads alike
        cache.k[batch.write] = qk[:, nq:]  # [T, kv_local, hd] into their blocks
        cache.v[batch.write] = v
    plan = batch.decode if native or paged_attention.usable(qk, cache.k) else None
    y = torch.empty(T, nq, heads.shape[2], dtype=heads.dtype, device=heads.device)
    if plan is not None:  # the decode rows: one native call (`kernels.paged_attention`)
        kv = paged_attention.kv_map(nq, cache.k.shape[1], at._kv_key)
        paged_attention.attend(qk[:, :nq], cache.k, cache.v, y, plan, kv)
        if plan.rows == T:
            return y  # every row was a decode row
    _pieces(at, qk[:, :nq], cache, y, plan is not None)
    return y


def _pieces(at, q: torch.Tensor, cache, y: torch.Tensor, decoded: bool) -> None:
    """Each sequence's rows q [n, nq, hd] over its own keys, in a fused attention of
    its own, into y (`decoded`: the one-token rows are done already)."""
    batch, nq = cache.batch, at.local_heads
    gqa, uneven = nq != cache.k.shape[1], at.kv_index is not None
    for first, n, keys, mask in batch.seqs:
        if decoded and n == 1:
            continue  # computed above
        k_i = _paged(cache.k, keys, batch.block_size).transpose(0, 1)[None]
        v_i = _paged(cache.v, keys, batch.block_size).transpose(0, 1)[None]  # [1, kv, L, hd]
        if uneven:
            k_i, v_i = at.for_queries(k_i), at.for_queries(v_i)
        q_i = q[first:first + n].transpose(0, 1)[None]  # [1, nq, n, hd]
        y[first:first + n] = F.scaled_dot_product_attention(
            q_i, k_i, v_i, mask, enable_gqa=gqa and not uneven)[0].transpose(0, 1)


def paged_angles(batch: PagedBatch, how: tuple, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, rd] (contiguous float32) of the rows' positions for rotary `how`
    (rope_dim, theta, llama3 scaling), made once per forward and shared by the layers."""
    angles = batch.angles.get(how)
    if angles is None:
        angles = batch.angles[how] = tuple(a.reshape(T, 1, -1).contiguous() for a in rope_at(
            batch.positions[:, None], *how[:2], batch.rope_len, how[2]))
    return angles


def _paged(flat: torch.Tensor, keys: slice | tuple[torch.Tensor, slice], block_size: int
           ) -> torch.Tensor:
    """A sequence's keys (or values) [L, kv_local, hd] from the flat cache (`PagedBatch`):
    a view where its blocks are adjacent, else its blocks gathered (a contiguous copy,
    the same values and strides as a gather of its positions)."""
    if isinstance(keys, slice):
        return flat[keys]
    table, part = keys
    return flat.view(-1, block_size, *flat.shape[1:])[table].flatten(0, 1)[part]
