"""The paged KV cache: prefix caching, memory that follows the tokens, chunked prefill,
preemption.

Checked: a second request sharing a 48-token system prompt computes only its own
tokens (the count of prompt tokens computed drops by the shared part), four submitted
in one step compute the shared part once (the others wait for the first one's
blocks, then take them from the cache; a wait on a request that stops progressing
ends after STALL steps), and the tokens and log-probabilities are bit for bit the
same with the cache and without it in the batch-invariant mode (greedy tokens the
same in the default mode), at tp=1 and at tp=2
with 9 heads (5 + 4 per rank: each rank holds its heads' blocks, rank 0's plan carries
the block tables), tp=2 giving tp=1's tokens; the KV memory of 8 short requests is a
small fraction of the max_batch x max_len reservation of the old pool; a step computes
the decodes and a piece of a long prompt in one forward; a cache too small for every
request preempts (recompute) and every request still ends with the tokens it gets
with room to spare (greedy: recomputing rounds otherwise, but these margins are
wide); the block pool's counts, chain keys and LRU eviction.
"""

from __future__ import annotations

import pytest
import torch

from checkpoint_helpers import LLAMA, SMOL, fill, random_full
from tpkit.decode.forms import for_decode
from tpkit.decode.paged_kv import LAST, PagedCache, Piece, forward
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.serve import Engine, SamplingParams
from tpkit.serve.blocks import BlockPool, block_keys
from tpkit.serve.request import Request
from tpkit.serve.runner import Runner
from tpkit.serve.scheduler import STALL, Scheduler
from tpkit.serve.sequence import Seq

SYSTEM = torch.randint(0, 257, (48,), generator=torch.Generator().manual_seed(1)).tolist()
TAILS = [torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(n)).tolist()
         for n in (5, 13, 20, 9)]
NEW = 6


def _model(mesh, config):
    """Decode-only weights, as `tpkit serve` loads them (`for_decode`): oneDNN's products
    give a row the same bits wherever it sits in the batch (MKL's F.linear does not
    always: with an odd input width, SMOL's 99, row 1 of two rounds unlike row 0)."""
    config = config.with_(max_seq_len=256)  # rotary: no weight depends on it
    model = Transformer(config, mesh)
    fill(model, random_full(config, seed=5, scale=1.0), mesh)
    return for_decode(model)


def prefix_worker(mesh, config):
    """Rank 0: the four prompts one after the other, with and without the prefix cache,
    in both decode modes; (tokens, log-probs, prompt tokens computed) of each."""
    model = _model(mesh, config)
    if mesh.tp_rank != 0:
        return Runner(model).follow()
    out = {}
    for chunk in (2, None):
        for caching in (True, False):
            engine = Engine(model, max_batch=4, max_len=96, decode_chunk=chunk, piece=16,
                            prefix_caching=caching)
            got = []
            for tail in TAILS:
                before = engine.metrics.prompt_tokens_computed
                r = engine.generate([SYSTEM + tail], SamplingParams(max_tokens=NEW))[0]
                got.append((r.tokens, r.logprobs,
                            engine.metrics.prompt_tokens_computed - before))
            out[chunk, caching] = got
            engine = Engine(model, max_batch=4, max_len=96, decode_chunk=chunk, piece=16,
                            prefix_caching=caching)  # the four submitted in one step
            done = engine.generate([SYSTEM + t for t in TAILS], SamplingParams(max_tokens=NEW))
            out[chunk, caching, "together"] = ([(r.tokens, r.logprobs) for r in done],
                                               engine.metrics.prompt_tokens_computed)
    Runner.stop_followers(model)
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("config", [LLAMA, SMOL], ids=["llama", "smol-9-heads"])
def test_a_shared_prefix_is_computed_once_and_changes_no_bit(run_tp, config):
    results = {}
    for tp in (1, 2):
        out = run_tp(prefix_worker, tp, config)[0]
        for chunk in (2, None):
            on, off = out[chunk, True], out[chunk, False]
            # the first computes all; the next ones only what follows the 48 shared tokens
            assert [n for _, _, n in off] == [48 + len(t) for t in TAILS]
            assert [n for _, _, n in on] == [48 + len(TAILS[0])] + [len(t) for t in TAILS[1:]]
            # submitted together: the first computes the 48 shared tokens, the others
            # wait for its blocks (the cache off: each computes them)
            (both, n_on), (both_off, n_off) = (out[chunk, c, "together"] for c in (True, False))
            assert (n_on, n_off) == (48 + sum(map(len, TAILS)), 4 * 48 + sum(map(len, TAILS)))
            if chunk is not None:  # batch invariant: the same bits, cache or not
                alone = [(t, lp) for t, lp, _ in off]
                assert [(t, lp) for t, lp, _ in on] == alone and both == both_off, tp
                assert both == alone, tp  # and together as alone
            alone = [t for t, _, _ in off]  # the same greedy tokens in every case
            assert [t for t, _, _ in on] == alone == [t for t, _ in both] == \
                [t for t, _ in both_off], tp
        results[tp] = out[2, True]
    assert len({tuple(t) for t, _, _ in results[1]}) == len(TAILS)  # not degenerate
    for (t1, lp1, _), (t2, lp2, _) in zip(results[1], results[2]):
        assert t1 == t2  # tp=2 (5 + 4 heads for SmolLM2's shape) gives tp=1's tokens
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) < 1e-3


def test_requests_arriving_together_wait_for_the_shared_blocks_a_bounded_time():
    """No model: A, B, C share SYSTEM, X shares nothing, all queued before one step. A
    and X are admitted, B and C wait (A is computing their prefix) and next step take
    its 3 blocks from the cache; if A's step never lands (it makes no progress), B
    waits STALL steps more, then computes the blocks itself."""
    def queue(sched):
        reqs = [Seq(Request(i, p, SamplingParams(max_tokens=4))) for i, p in enumerate(
            [SYSTEM + TAILS[0], SYSTEM + TAILS[1], [9] * 40, SYSTEM + TAILS[2]])]
        sched.waiting.extend(reqs)
        return reqs

    sched = Scheduler(BlockPool(16, 64), max_batch=4, max_tokens_in_flight=10**6,
                      prefill_per_step=0, chunk=None, piece=16)
    a, b, x, c = queue(sched)
    out = sched.schedule()
    assert out.admitted == [a, x] and list(sched.waiting) == [b, c]
    assert out.prompt_tokens == 48 + len(TAILS[0]) + 40
    sched.computed(out)
    out = sched.schedule()
    assert out.admitted == [b, c] and (b.cached, c.cached) == (3, 3)
    assert out.prompt_tokens == len(TAILS[1]) + len(TAILS[2])
    stalled = Scheduler(BlockPool(16, 64), max_batch=4, max_tokens_in_flight=10**6,
                        prefill_per_step=0, chunk=None, piece=16)
    a, b, x, c = queue(stalled)
    for _ in range(1 + STALL):  # A admitted, then STALL steps that compute nothing
        assert stalled.schedule().admitted in ([a, x], [])
    assert stalled.schedule().admitted == [b, c] and b.cached == 0


def test_kv_memory_follows_the_tokens_in_flight():
    """8 requests of 20-token prompts + 8 new tokens at max_batch 8, max_len 256: the
    cache holds the blocks they use (it grows by 16 blocks or by half), a small
    fraction of what 8 slots of 256 tokens reserved before."""
    model = _model(ParallelMesh.single(), LLAMA)
    engine = Engine(model, max_batch=8, max_len=256)
    prompts = [[(7 * i + j) % 257 for j in range(20)] for i in range(8)]
    engine.generate(prompts, SamplingParams(max_tokens=8))
    per_token = PagedCache.block_bytes(model, 1)
    reserved = 8 * 256 * per_token  # the slot pool it replaced (8 slots of 256 tokens)
    held = engine.runner.cache.nbytes()
    assert held == engine.pool.size * 16 * per_token
    assert engine.pool.size == 17  # 8 x 2 blocks of 16 for 28 tokens each, + block 0
    assert held / reserved == 17 * 16 / (8 * 256)  # 0.13 here (SmolLM2 at 8k: 0.004)
    assert engine.kv_cache_bytes == reserved  # the default ceiling: the old worst case


def test_decodes_and_a_piece_of_a_long_prompt_share_a_step(monkeypatch):
    """Default mode, a 16-token prompt budget: while a request decodes, a 40-token prompt
    is computed in pieces of 16, 16, 8, each in the same forward as the decode."""
    from tpkit.decode import paged_kv

    model = _model(ParallelMesh.single(), LLAMA)
    engine = Engine(model, max_batch=4, max_len=96, prefill_per_step=16)
    rows, layout = [], paged_kv.layout
    monkeypatch.setattr(paged_kv, "layout", lambda pieces, *a: rows.append(
        sum(len(p.tokens) for p in pieces)) or layout(pieces, *a))  # each forward's rows
    first = engine.submit([3, 4, 5], SamplingParams(max_tokens=10))
    engine.step()
    second = engine.submit(list(range(1, 41)), SamplingParams(max_tokens=2))
    while engine.busy:
        engine.step()
    assert rows[:5] == [3, 17, 17, 9, 2]  # 3; 16 + 1 decode; again; 8 + 1; 2 decodes
    assert len(first.tokens) == 10 and len(second.tokens) == 2


def test_a_full_cache_preempts_and_recomputes():
    """5 blocks of 16 tokens for 4 requests of 12 + 14 tokens (2 blocks each at the
    end): requests are preempted and recomputed, and each ends with its tokens of a
    roomy cache."""
    model = _model(ParallelMesh.single(), LLAMA)
    prompts = [[(11 * i + j) % 257 for j in range(12)] for i in range(4)]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    roomy = Engine(model, max_batch=4, max_len=96).generate(prompts, params)
    tight = Engine(model, max_batch=4, max_len=96,
                   kv_cache_bytes=5 * PagedCache.block_bytes(model, 16))
    got = tight.generate(prompts, params)
    assert tight.metrics.preemptions > 0
    assert [r.tokens for r in got] == [r.tokens for r in roomy]
    assert tight.pool.size == 6 and tight.pool.in_use == 0


def test_block_pool_counts_chains_and_evicts_least_recent():
    pool = BlockPool(block_size=2, max_blocks=4)  # blocks 1..3
    a = [1, 2, 3, 4, 5]
    keys = block_keys(a, 2)
    assert len(keys) == 2 and keys == block_keys(a + [9], 2)[:2]
    assert block_keys([9, 2, 3, 4], 2)[1] != keys[1]  # a block's key holds its prefix
    got = pool.allocate(3)
    assert sorted(got) == [1, 2, 3] and pool.allocate(1) is None
    pool.register(got[0], keys[0])
    pool.register(got[1], keys[1])
    pool.release(got)
    assert pool.in_use == 0 and pool.available == 3
    assert pool.lookup(keys) == got[:2] and pool.in_use == 2  # found, in use again
    pool.release(got[:2])
    pool.lookup(keys[:1])  # block got[0] used last: got[1] is the older one
    pool.release(got[:1])
    assert pool.allocate(2) is not None  # the free block, then the LRU cached one
    assert pool.lookup(keys) == [got[0]]  # got[1] was evicted, got[0] kept


def test_scattered_blocks_give_the_bits_of_adjacent_ones():
    """A sequence's keys gathered from scattered blocks (a block at a time) give the
    logits of the same keys read in place from adjacent blocks, bit for bit."""
    model = _model(ParallelMesh.single(), LLAMA)
    ids = [(5 * j + 3) % 257 for j in range(45)]
    got = []
    for table in ([1, 2, 3], [7, 2, 5]):
        cache = PagedCache(model, 16)
        cache.grow(8)
        forward(model, cache, [Piece(ids[:40], 0, table, LAST)])
        got.append(forward(model, cache, [Piece([3], 9, [4], LAST),  # another sequence
                                          Piece(ids[40:], 40, table, LAST)])[0])
    assert torch.equal(got[0], got[1])
