"""The serving engine without HTTP: continuous batching, the KV pool, the sampler.

Math checked: a request's greedy tokens AND the log-probabilities of every chosen token
are bit for bit the same alone and among 15 others of different lengths (more
requests than slots, so some wait in the queue and are admitted mid-flight), at tp=1
and tp=2 (tp=2 equal to tp=1 token for token, log-probs to float32 round-off); a seed
decides a sampled request whatever shares the batch; top-p keeps the smallest nucleus
of mass >= p; a request that does not fit the token budget waits, one that can never
fit is refused; a cancelled request frees its slot.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint_helpers import GPT2, LLAMA, fill, random_full
from tpkit.decode.paged_kv import PagedCache
from tpkit.decode.sampling import filtered
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.serve import Engine, SamplingParams, TooLong
from tpkit.serve.params import StopText
from tpkit.serve.request import Request
from tpkit.serve.runner import Runner
from tpkit.serve.speculate import Speculator
from tpkit.spec.errors import UserError

SLOTS, MAX_LEN, NEW, CHUNK = 4, 32, 6, 2  # decode in 2 chunks of 2 slots
PROMPTS = [torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (1, 7, 2, 19, 4, 11, 3, 24, 5, 9, 13, 6, 16, 8, 21, 10)]  # 16 lengths


def _model(mesh, config):
    model = Transformer(config, mesh)
    fill(model, random_full(config, seed=5, scale=1.0), mesh)
    return model


def batch_worker(mesh, config, sampled: bool, chunk: int = CHUNK):
    """Rank 0: every prompt alone, then all 16 at once; the others follow."""
    model = _model(mesh, config)
    if mesh.tp_rank != 0:
        return Runner(model).follow()
    engine = Engine(model, max_batch=SLOTS, max_len=MAX_LEN, decode_chunk=chunk)
    params = [SamplingParams(max_tokens=NEW, temperature=0.9 if sampled else 0.0, top_p=0.9,
                             seed=i) for i in range(len(PROMPTS))]
    alone = [engine.generate([p], q)[0] for p, q in zip(PROMPTS, params)]
    together = [engine.submit(p, q) for p, q in zip(PROMPTS, params)]
    seen_queue = len(engine.scheduler.waiting)  # more requests than slots: some wait
    while engine.busy:
        engine.step()
    engine.runner.lead_stop()
    return ([(r.tokens, r.logprobs) for r in alone], [(r.tokens, r.logprobs) for r in together],
            seen_queue, engine.metrics.render())


@pytest.mark.timeout(150)
@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_greedy_is_the_same_bits_alone_and_in_any_batch(run_tp, config):
    """16 prompts of 1..24 tokens: alone == together (tokens and log-probs, exactly);
    Llama (rotary, GQA) at tp=1 and tp=2, GPT-2 (learned positions) at tp=1."""
    results = {}
    for tp in (1, 2) if config is LLAMA else (1,):
        alone, together, queued, metrics = run_tp(batch_worker, tp, config, False)[0]
        assert together == alone, tp  # bit for bit: the batch never changes a row
        assert queued == len(PROMPTS), tp  # submitted before any step: all waited
        assert f'tpkit_requests_total{{finish="length"}} {2 * len(PROMPTS)}.0' in metrics
        assert len({tuple(t) for t, _ in alone}) == len(PROMPTS)  # not a degenerate model
        results[tp] = alone
    for (t1, lp1), (t2, lp2) in zip(results[1], results.get(2, results[1])):
        assert t1 == t2  # tp=2 gives tp=1's tokens
        # the split sums round differently: log p = logit - logsumexp, both ~1e2 here,
        # so float32 round-off of 1e-5 relative is ~1e-3 absolute
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) < 1e-3


def test_a_request_is_the_same_bits_whatever_the_pool_length():
    """Each row attends over its own cached keys only: the pool's max_len (how much of
    every slot is empty) changes no bit of a request (Llama: rotary, GQA)."""
    model = _model(ParallelMesh.single(), LLAMA)
    got = []
    for max_len in (MAX_LEN, 2 * MAX_LEN):
        engine = Engine(model, max_batch=SLOTS, max_len=max_len, decode_chunk=CHUNK)
        reqs = engine.generate(PROMPTS[:6], SamplingParams(max_tokens=NEW))
        got.append([(r.tokens, r.logprobs) for r in reqs])
    assert got[0] == got[1]


def test_prefill_per_step_spreads_prompts_and_changes_no_bit():
    """At most `prefill_per_step` prompt tokens are computed in a step (one piece at
    least), the running requests decoding in between; in the batch-invariant mode a
    prompt is cut at multiples of its piece size whatever the budget, so every
    request's bits are unchanged."""
    model = _model(ParallelMesh.single(), GPT2)
    prompts = PROMPTS[:4]  # 1, 7, 2 and 19 tokens
    got, computed = [], []
    for limit in (0, 8):
        engine = Engine(model, max_batch=SLOTS, max_len=MAX_LEN, decode_chunk=CHUNK,
                        prefill_per_step=limit, piece=16)
        reqs = [engine.submit(p, SamplingParams(max_tokens=NEW)) for p in prompts]
        counts = []
        while engine.busy:
            before = engine.metrics.prompt_tokens_computed
            engine.step()
            counts.append(engine.metrics.prompt_tokens_computed - before)
        computed.append(counts[:4])
        got.append([(r.tokens, r.logprobs) for r in reqs])
    # no limit: 1 + 7 + 2 + 16 (19's first piece of 16), then its last 3
    # limit 8: 1 + 7; 2; 16 (one piece runs even over the limit); 3
    assert computed == [[26, 3, 0, 0], [8, 2, 16, 3]]
    assert got[0] == got[1]
    with pytest.raises(UserError, match="prefill_per_step=-1 must be >= 0"):
        Engine(model, max_batch=SLOTS, max_len=MAX_LEN, prefill_per_step=-1)


def test_a_seed_decides_a_sampled_request_whatever_the_batch():
    alone, together, _, _ = batch_worker(ParallelMesh.single(), GPT2, True)
    assert together == alone
    one, together_one, _, _ = batch_worker(ParallelMesh.single(), GPT2, True, 1)
    assert together_one == one  # every slot decoded alone: invariant too
    assert len({tuple(t) for t, _ in alone}) == len(PROMPTS)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: (filtered(logits, 1.0, None, p) > float("-inf")).sum().item()  # noqa: E731
    assert [kept(p) for p in (0.4, 0.5, 0.79, 0.8, 0.81, 0.96, 1.0)] == [1, 1, 2, 2, 3, 4, 4]
    assert (filtered(logits, 1.0, 2, None) > float("-inf")).sum() == 2  # top-k


def test_stop_text_holds_back_what_may_begin_a_stop():
    st = StopText(("END", "\n\n"))
    assert st.add("abc E") == ("abc", False)  # " E" may begin "END": held
    assert st.add("N") == (" ", False)
    assert st.add("Dxyz") == ("", True)  # the stop found: nothing of it or after it
    assert st.text == "abc " and st.flush() == ""
    free = StopText(())
    assert free.add("abc") == ("abc", False) and free.flush() == ""


def test_budget_queue_refusal_and_cancel():
    model = _model(ParallelMesh.single(), GPT2)
    engine = Engine(model, max_batch=2, max_len=MAX_LEN, max_tokens_in_flight=30)
    with pytest.raises(TooLong, match=f"= 36 exceeds the context of {MAX_LEN}"):
        engine.submit([1] * 30, SamplingParams(max_tokens=6))
    with pytest.raises(TooLong, match="max-tokens-in-flight=30"):
        engine.submit([1] * 26, SamplingParams(max_tokens=6))
    a = engine.submit([1] * 10, SamplingParams(max_tokens=8))  # 18 of 30
    b = engine.submit([2] * 10, SamplingParams(max_tokens=8))  # would make 36: waits
    engine.step()
    engine.step()
    slot = {s.id: s.slot for s in engine.scheduler.running}  # the engine's `Seq`s
    assert slot.get(a.id) is not None and b.id not in slot and len(a.tokens) == 2
    assert engine.pool.in_use == 1  # 11 tokens in flight: one block of 16
    a.cancel()
    engine.step()  # a's place and blocks are free: b runs
    engine.step()
    slot = {s.id: s.slot for s in engine.scheduler.running}
    assert a.finish_reason == "cancelled" and slot.get(b.id) is not None and len(b.tokens) == 2
    while engine.busy:
        engine.step()
    assert b.finish_reason == "length" and len(b.tokens) == 8
    assert engine.pool.in_use == 0


def test_a_step_writes_the_callers_handle_only_through_push_finish_and_fail(monkeypatch):
    """Issue 48's Request split: the engine's state is its own (`serve.sequence.Seq`); the
    caller's handle is written only inside its own methods (the engine's thread: push,
    finish, fail), whatever runs: greedy and sampled with echo and log-probabilities,
    n-gram speculation, a preemption (a KV cache of 4 blocks), a cancel."""
    writers: set[tuple[str, str, str]] = set()
    setter = Request.__setattr__

    def spy(self, name, value):
        code = sys._getframe(1).f_code
        writers.add((Path(code.co_filename).name, code.co_name, name))
        setter(self, name, value)

    monkeypatch.setattr(Request, "__setattr__", spy)
    model = _model(ParallelMesh.single(), GPT2)
    engine = Engine(model, max_batch=3, max_len=MAX_LEN,
                    kv_cache_bytes=4 * PagedCache.block_bytes(model, 16),
                    speculator=Speculator(tokens=2, row_cost=0.0))
    reqs = [engine.submit(PROMPTS[i], SamplingParams(max_tokens=6, ignore_eos=True, **kw))
            for i, kw in [(3, {}), (12, dict(temperature=0.9, seed=1, logprobs=2, echo=True)),
                          (10, dict(logprobs=0)), (1, {})]]  # 2 + 1 + 1 blocks, then grow
    engine.step()
    reqs[3].cancel()
    while engine.busy:
        engine.step()
    assert [r.finish_reason for r in reqs] == ["length"] * 3 + ["cancelled"]
    assert engine.metrics.preemptions > 0 and len(reqs[1].prompt_logprobs) == len(PROMPTS[12])
    outside = {w for w in writers if w[0] != "request.py"}
    assert not outside, outside
    assert {w[1] for w in writers} <= {"__init__", "push", "finish", "fail"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_readme_engine_example_runs(tmp_path):
    """docs/serving.md, "The engine without HTTP": the Engine example, as written, on a
    saved llama-t checkpoint."""
    from tpkit.checkpoint import store

    root = Path(__file__).resolve().parent.parent
    section = (root / "docs" / "serving.md").read_text().split(
        "## The engine without HTTP", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[-1]
    (tmp_path / "engine.py").write_text(code)
    store.save(tmp_path / "ckpt", _model(ParallelMesh.single(), LLAMA))
    out = subprocess.run([sys.executable, str(tmp_path / "engine.py"), str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=170,
                         env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("first prompt:") == 8 and "batched = alone" in out.stdout
