"""Greedy decoding on the vocabulary-parallel shards (tp > 1): each rank sends its best
(value, token, log-sum-exp: [b, 3] float32) instead of its logits [b, V/tp].

Math checked at tp=2: the token is exactly torch's argmax of the whole row (the first
largest, ties across ranks included; the vocabulary padding never wins, even where
every real logit is negative), its log-probability log_softmax's to float32 round-off,
and the gathered bytes are b * 3 * 4 per rank against b * V_pad/tp * 4 (the ledger).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from checkpoint_helpers import LLAMA, fill, random_full
from tpkit.decode.paged_kv import PagedCache, Piece, _greedy, forward
from tpkit.model.transformer import Transformer

V = 7  # a vocabulary of 7 over tp=2: shards of 4, the last column padding


def shard_worker(mesh, full):
    """`_greedy` on hand-made logits `full` [b, 8] (column 7: padding), this rank's half."""
    n = full.shape[1] // mesh.tp_size
    mine = full[:, mesh.tp_rank * n:(mesh.tp_rank + 1) * n]
    model = SimpleNamespace(logits=lambda h: mine[:, None], group=mesh.tp_group,
                            config=SimpleNamespace(vocab_size=V))
    return _greedy(model, torch.zeros(full.shape[0], 1, 1))


def test_the_shards_pick_the_first_largest_and_never_the_padding(run_tp):
    full = torch.tensor([[0., 3., 1., 2., 3., 0., 1., 0.],  # a tie across ranks: token 1
                         [0., 1., 1., 2., 5., 5., 1., 0.],  # a tie on rank 1: token 4
                         [-4., -3., -2., -5., -6., -9., -1., 0.],  # padding 0 > all real
                         [2., 2., 2., 2., 2., 2., 2., 9.]])  # ties everywhere: token 0
    want = full[:, :V].argmax(-1)
    logp = full[:, :V].log_softmax(-1)
    for got in run_tp(shard_worker, 2, full):
        assert torch.equal(got[:, 0].long(), want), got
        assert torch.allclose(got[:, 1], logp[torch.arange(4), want], atol=1e-6)


def decode_worker(mesh):
    """Rank by rank: full logits and the shards' greedy of one decode of 3 sequences."""
    model = Transformer(LLAMA, mesh).eval()
    fill(model, random_full(LLAMA, seed=5, scale=1.0), mesh)
    cache = PagedCache(model, block_size=4)
    cache.grow(7)
    seqs = [([5, 17, 200], [1]), ([9], [2]), ([1, 2, 3, 4, 5, 6], [3, 5])]
    for ids, blocks in seqs:
        forward(model, cache, [Piece(ids, 0, blocks)])
    step = [Piece([tok], len(ids), blocks) for tok, (ids, blocks) in zip([7, 8, 9], seqs)]
    logits = forward(model, cache, step)[0]  # [3, V]
    mesh.ledger.clear()
    best = forward(model, cache, step, greedy=True)[0]  # the same step again: [3, 2]
    gathers = [r.nbytes for r in mesh.ledger.records if r.op == "all_gather"]
    pad = model.head_weight.shape[0]  # V_pad / tp rows of the head on this rank
    return logits, best, gathers, pad


@pytest.mark.timeout(120)
def test_greedy_decode_on_shards_equals_the_argmax_of_the_gathered_logits(run_tp):
    for logits, best, gathers, pad in run_tp(decode_worker, 2):
        busy = [0, 1, 2]  # every sequence
        assert torch.equal(best[busy, 0].long(), logits[busy].argmax(-1))
        lp = logits[busy].log_softmax(-1).gather(1, logits[busy].argmax(-1)[:, None])[:, 0]
        assert (best[busy, 1] - lp).abs().max() < 1e-5
        assert len(set(logits[busy].argmax(-1).tolist())) > 1  # not a degenerate row
        assert gathers == [3 * 2 * 3 * 4]  # [3 rows, 3] float32 from 2 ranks
        assert 3 * 2 * pad * 4 > 20 * gathers[0]  # what the logits' all-gather carries


@pytest.mark.parametrize("n", [1, 7, 8, 49152])
def test_the_native_best_is_torchs_argmax_and_logsumexp(n):
    """decode_ops.shard_best (tp=1's greedy and each shard's): the first largest column
    exactly, NaN counted as the largest as torch's argmax, the padding after column n
    never read; the log-sum-exp within 4 float32 ulps of float64's (its exp: a
    polynomial); a shard's columns offset to token ids, a shard of padding alone -inf."""
    from tpkit.kernels import decode_ops

    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n + 3, generator=g) * 8  # 3 columns of padding past n
    x[:, n:] = 1e9  # what `best` must not read
    x[1, n // 2] = x[1, n - 1] = 40.0  # a tie: the first
    x[2, :n] = -3e4  # every term under exp's range but the largest
    x[2, n - 1] = -2e4
    x[3, n - 1] = float("nan")  # NaN after the largest: the NaN
    x[4, :n] = 0.0  # all equal: column 0
    got = decode_ops.shard_best(x, 0, n)
    real = x[:, :n]
    assert torch.equal(got[:, 1].long(), real.argmax(-1))
    top = real.double().amax(-1)
    lse = real.double().logsumexp(-1)
    ok = [0, 1, 2, 4]
    assert torch.equal(got[ok, 0].double(), top[ok])
    ulp = torch.finfo(torch.float32).eps * lse[ok].abs().clamp(min=1)
    assert ((got[ok, 2].double() - lse[ok]).abs() <= 4 * ulp).all(), (got[ok, 2], lse[ok])
    assert got[3, 0].isnan() and got[3, 2].isnan()
    later = decode_ops.shard_best(x, 1000, 1000 + n)  # the same shard, tokens 1000 ..
    assert torch.equal(later[ok, 1], got[ok, 1] + 1000) and torch.equal(later[ok, 2], got[ok, 2])
    pad = decode_ops.shard_best(x, 1000, 1000)  # past the vocabulary: padding alone
    assert (pad[:, 0] == float("-inf")).all() and (pad[:, 2] == float("-inf")).all()
