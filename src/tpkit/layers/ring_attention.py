"""Ring attention over a context-parallel group (Liu et al. 2023; Megatron-Core's CP).

The sequence of S tokens is split over cp ranks in load-balanced causal chunks
(`tpkit.spec.shapes.cp_chunks`: rank r holds chunk r and chunk 2cp-1-r of 2cp). Each
rank keeps its queries; the keys and values travel around the ring, one block per step,
while the rank computes attention against the block it holds:

    step t:  rank r holds the k/v block of rank (r - t) mod cp
             isend it to r+1, irecv the next from r-1   (posted before the block math)
             scores = q k^T / sqrt(d), masked by GLOBAL positions (query >= key)
             online softmax (Milakov & Gimelshein 2018): running max m, sum l, output o
    o / l is softmax(q K^T) V over the whole sequence; lse = m + log l is kept.

Backward runs the ring again: the k/v blocks travel as in forward (the next one posted
before the block math), and each block's gradient (dk, dv) follows one hop behind: a
rank computes its queries' share of the block it holds while the share accumulated so
far by the ranks before it is on its way, adds the two and sends the sum on; after cp
hops every dk, dv is back with its owner:

    per layer and micro-batch:  forward  (cp-1) x send + recv of k,v            (2 n each)
                                backward (cp-1) x send + recv of k,v, and
                                         cp x send + recv of dk,dv              (2 n each)
    n = b * kv_heads/tp * S/cp * head_dim   (`tpkit.spec.theory.context_parallel`)

Grouped-query heads travel unrepeated (kv_local heads), repeated only for the math.
"""

from __future__ import annotations

import math

import torch

from tpkit.comm.collectives import irecv, isend
from tpkit.comm.group import CommGroup
from tpkit.spec.shapes import cp_chunks


def cp_positions(seq_local: int, group: CommGroup, rank: int | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """Global positions [S/cp] of the tokens rank `rank` (default: this one) holds."""
    rank = group.rank if rank is None else rank
    spans = cp_chunks(seq_local * group.size, group.size, rank)
    return torch.cat([torch.arange(a, b, device=device) for a, b in spans])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup
                   ) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence.

    q [b, hq, s, d], k and v [b, hkv, s, d] (s = S/cp, this rank's chunks) -> [b, hq, s, d].
    """
    return _RingAttention.apply(q, k, v, group)


def _send_recv(x: torch.Tensor, group: CommGroup, phase: str):
    """Post the ring hop of `x`: to r+1, from r-1; returns (send, recv) handles."""
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    buf = torch.empty_like(x)
    send = isend(x, group, nxt, phase=phase, scope="context_parallel")
    recv = irecv(buf, group, prev, phase=phase, scope="context_parallel")
    return send, recv


def _scores(q, k, qpos, kpos, g: int):
    """Masked scores [b, hq, s, s] of q against a k block (repeated for GQA)."""
    kr = k.repeat_interleave(g, dim=1) if g > 1 else k  # [b, hq, s, d]
    s = torch.matmul(q, kr.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [b, hq, s, s]
    return s.masked_fill(qpos[:, None] < kpos[None, :], float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):
        cp, r, g = group.size, group.rank, q.shape[1] // k.shape[1]
        qpos = cp_positions(q.shape[2], group, device=q.device)
        m = torch.full((*q.shape[:3], 1), float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)  # noqa: E741 - the running softmax sum, as in the papers
        o = torch.zeros_like(q)  # [b, hq, s, d]
        kv = torch.stack([k, v]).contiguous()  # [2, b, hkv, s, d]
        for t in range(cp):
            pending = _send_recv(kv, group, "forward") if t < cp - 1 else None
            kpos = cp_positions(q.shape[2], group, (r - t) % cp, q.device)
            s = _scores(q, kv[0], qpos, kpos, g)  # [b, hq, s, s]
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # finite: t=0 holds the diagonal
            p = torch.exp(s - m_new)
            scale = torch.exp(m - m_new)
            vr = kv[1].repeat_interleave(g, dim=1) if g > 1 else kv[1]
            l = l * scale + p.sum(-1, keepdim=True)  # noqa: E741
            o = o * scale + torch.matmul(p, vr)
            m = m_new
            if pending is not None:
                pending[0].wait()
                kv = pending[1].wait()
        o = o / l
        ctx.group = group
        ctx.save_for_backward(q, k, v, o, m + torch.log(l))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        group = ctx.group
        cp, r = group.size, group.rank
        nxt, prev = (r + 1) % cp, (r - 1) % cp
        delta = (do * o).sum(-1, keepdim=True)  # [b, hq, s, 1]
        dq = torch.zeros_like(q)
        kv, acc_send = torch.stack([k, v]).contiguous(), None  # [2, b, hkv, s, d]
        for t in range(cp):
            # posted in the order the previous rank sends: its last gradients, then k/v
            acc_recv = _post_recv(kv, group, prev) if t > 0 else None
            hop = _send_recv(kv, group, "backward") if t < cp - 1 else None
            mine = _block_grads(q, kv, do, lse, delta, dq, group, (r - t) % cp)  # [2, ...]
            acc = mine if acc_recv is None else acc_recv.wait().add_(mine)
            if acc_send is not None:
                acc_send.wait()
            acc_send = isend(acc, group, nxt, phase="backward", scope="context_parallel")
            if hop is not None:
                hop[0].wait()
                kv = hop[1].wait()
        home = _post_recv(kv, group, prev).wait()  # dk, dv of this rank's own block
        acc_send.wait()
        return dq, home[0], home[1], None


def _post_recv(like: torch.Tensor, group: CommGroup, src: int):
    return irecv(torch.empty_like(like), group, src, phase="backward", scope="context_parallel")


def _block_grads(q, kv, do, lse, delta, dq, group: CommGroup, src: int) -> torch.Tensor:
    """This rank's queries' share of d(k, v) of block `src` [2, b, hkv, s, d]; adds the
    block's share of dq into `dq`."""
    g = q.shape[1] // kv.shape[2]
    qpos = cp_positions(q.shape[2], group, device=q.device)
    kpos = cp_positions(q.shape[2], group, src, q.device)
    kb, vb = kv[0], kv[1]
    p = torch.exp(_scores(q, kb, qpos, kpos, g) - lse)  # [b, hq, s, s]
    vr = vb.repeat_interleave(g, dim=1) if g > 1 else vb
    kr = kb.repeat_interleave(g, dim=1) if g > 1 else kb
    ds = p * (torch.matmul(do, vr.transpose(-1, -2)) - delta) / math.sqrt(q.shape[-1])
    dq += torch.matmul(ds, kr)
    dk = torch.matmul(ds.transpose(-1, -2), q)  # [b, hq, s, d]
    dv = torch.matmul(p.transpose(-1, -2), do)
    return torch.stack([_fold(dk, g), _fold(dv, g)])


def _fold(x: torch.Tensor, g: int) -> torch.Tensor:
    """Sum the g query heads that share each kv head: [b, hq, s, d] -> [b, hkv, s, d]."""
    if g == 1:
        return x
    b, hq, s, d = x.shape
    return x.view(b, hq // g, g, s, d).sum(2)
