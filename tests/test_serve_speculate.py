"""N-gram speculative decoding (`serve.speculate`): proposals verified as decode rows of
one forward, the KV rolled back past the first rejected one.

Math checked: with proposals that are the reference tokens, one of them made wrong in
about half the proposals (so every path runs: all accepted, first rejected, one in the
middle rejected, the bonus token, max_tokens cutting a proposal), every request's
tokens, log-probabilities and top log-probabilities are bit for bit those without
speculation, float32 and bfloat16, default and batch-invariant modes, with the prefix
cache hit, at tp=1 and tp=2; no KV block is held past a request's tokens after a step;
a sequence whose proposals fail backs off; sampled requests are not speculated.
"""

from __future__ import annotations

import random

import pytest
import torch

from checkpoint_helpers import LLAMA, fill, random_full
from helpers import generate_args
from tpkit.checkpoint import store as ckpt
from tpkit.commands.generate import run
from tpkit.decode.forms import for_decode
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.serve import Engine, SamplingParams
from tpkit.serve.runner import Runner
from tpkit.serve.speculate import (
    PRIOR,
    ROW_COST,
    Speculator,
    StepCost,
    _State,
    lookup,
    worth,
)
from tpkit.spec.errors import UserError

CONFIG = LLAMA.with_(max_seq_len=128)
SHARED = torch.randint(0, 257, (33,), generator=torch.Generator().manual_seed(3)).tolist()
PROMPTS = [SHARED + [5, 9], SHARED + [7], [1, 2, 3], SHARED[:20]]  # two prefix-cache hits
NEW = [24, 3, 24, 24]  # max_tokens: 3 cuts proposals short


class Oracle(Speculator):
    """Proposes the reference continuation, one token made wrong in about half the
    proposals (seeded); `wrong`: every proposal's first token wrong."""

    def __init__(self, ref: dict[tuple, list[int]], tokens: int = 5, wrong: bool = False,
                 row_cost: float = 0.0):
        super().__init__(tokens, row_cost=row_cost)
        self.ref, self.wrong, self.rng = ref, wrong, random.Random(0)

    def lookup(self, st, req, k):
        d = list(self.ref[tuple(req.prompt)][len(req.tokens):len(req.tokens) + k])
        if d and (self.wrong or self.rng.random() < 0.5):
            i = 0 if self.wrong else self.rng.randrange(len(d))
            d[i] = (d[i] + 1) % CONFIG.vocab_size
        return d


def _params(logprobs):
    return [SamplingParams(max_tokens=n, logprobs=logprobs) for n in NEW]


def _run(engine, logprobs, together):
    """Every prompt (together, or one after the other): [(tokens, logprobs, top)]; asserts
    after each step that no request holds a block past its tokens (default mode)."""
    groups = [list(range(len(PROMPTS)))] if together else [[i] for i in range(len(PROMPTS))]
    out = []
    for group in groups:
        reqs = [engine.submit(PROMPTS[i], _params(logprobs)[i]) for i in group]
        while engine.busy:
            engine.step()
            for r in engine.scheduler.running:
                n = len(r.prompt) + len(r.tokens)  # a decoding one: blocks for these only
                if engine.scheduler.chunk is None and r.computed == n - 1:
                    assert len(r.blocks) <= -(-n // 16), (n, r.blocks)
        out += [(r.tokens, r.logprobs, r.top) for r in reqs]
    assert engine.pool.in_use == 0
    return out


def exact_worker(mesh, dtype, chunk):
    """Rank 0: together without log-probabilities, then alone with them (batch invariant:
    together with them), each without then with speculation, on one runner; (reference, speculated, proposed, accepted)."""
    model = Transformer(CONFIG, mesh)
    fill(model, random_full(CONFIG, seed=5, scale=1.0), mesh)
    model = for_decode(model.to(dtype))
    runner = Runner(model)
    if mesh.tp_rank != 0:
        return runner.follow()
    got = []
    # the greedy native path; then full logits, log-probabilities and their top 2
    ways = ((True, None), (False, 2)) if chunk is None else ((True, 2),)
    for together, logprobs in ways:
        ref = _run(Engine(model, max_batch=8, decode_chunk=chunk, runner=runner),
                   logprobs, together)
        spec = Oracle({tuple(p): r[0] for p, r in zip(PROMPTS, ref)})
        engine = Engine(model, max_batch=8, decode_chunk=chunk, runner=runner,
                        speculator=spec)
        got.append((ref, _run(engine, logprobs, together), spec.proposed, spec.accepted))
    runner.lead_stop()
    return got


def _check(got):
    for ref, spec, proposed, accepted in got:
        assert spec == ref  # tokens, log-probabilities, top: bit for bit
        assert 0 < accepted < proposed  # both paths ran
        assert len({tuple(t) for t, _, _ in ref}) == len(PROMPTS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype, chunk", [(torch.float32, None), (torch.float32, 8),
                                          (torch.bfloat16, 8)],
                         ids=["f32-default", "f32-invariant", "bf16-invariant"])
def test_speculated_tokens_are_the_same_bits(dtype, chunk):
    _check(exact_worker(ParallelMesh.single(), dtype, chunk))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_speculated_tokens_are_the_same_bits_at_tp2(run_tp):
    _check(run_tp(exact_worker, 2, torch.bfloat16, None)[0])


def test_lookup_proposes_what_followed_the_latest_match():
    st = _State(4)
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(st, ctx, 3) == [7, 8, 5]  # (2, 3): its latest earlier match, at 6..8
    assert lookup(st, ctx + [7, 8], 2) == [5, 2]  # (3, 7, 8): longest n first
    assert lookup(_State(4), [4, 5, 6, 7], 3) == []  # nothing to look up
    assert lookup(_State(4), [4, 5, 4, 5], 3) == [4, 5]  # what exists after it


def _tiny():
    mesh = ParallelMesh.single()
    model = Transformer(CONFIG, mesh)
    fill(model, random_full(CONFIG, seed=5, scale=1.0), mesh)
    return for_decode(model)


def test_failing_proposals_back_off_and_metrics_count_them():
    """Proposals whose first token is always wrong: the sequence's k halves, then it
    rests, doubling, so that over 120 tokens it proposes a few tokens only; /metrics
    counts them."""
    model = _tiny()
    ref = Engine(model).generate([[1, 2, 3]], SamplingParams(max_tokens=120))[0].tokens
    spec = Oracle({(1, 2, 3): ref}, wrong=True)
    engine = Engine(model, speculator=spec)
    assert "tpkit_spec" not in engine.metrics.render()  # nothing before a step
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=120))[0].tokens == ref
    assert spec.accepted == 0 and spec.proposed <= 14  # 5, 2, 1, then 1 after 1, 2, 4.. steps
    text = engine.metrics.render()
    assert f"tpkit_spec_proposed_tokens_total {spec.proposed}.0" in text
    assert "tpkit_spec_acceptance_rate 0.0" in text


def test_rows_are_proposed_only_where_they_pay_at_the_measured_cost():
    """The never-lose rule: a step of 1 decode row measured at 10 ms, one with 2 more
    rows at 14 ms (medians of the last steps, a shape's first not counted): a row costs
    0.2 of a step; at acceptance 0.5 two tokens pay (0.5,
    0.25), a third (0.125) does not. Rows dearer than a step (no token can pay): a
    sequence whose tokens are likely accepted proposes one probe after each rest only
    (re-measuring the cost), its tokens unchanged."""
    cost = StepCost()
    assert cost.per_row(1) == ROW_COST  # unmeasured
    cost.observe(1, 0, 0.5)  # each shape's first step (a warm-up) is not counted
    cost.observe(1, 2, 1.0)
    for seconds in (0.010, 0.010, 0.014, 0.010, 0.014):
        cost.observe(1, 0 if seconds == 0.010 else 2, seconds)
    assert cost.per_row(1) == pytest.approx(0.2, rel=1e-9) and cost.per_row(4) == ROW_COST
    cost.observe(1, 2, 0.5)  # one step slowed by the machine: medians, no jump
    cost.observe(1, 0, 0.2)
    assert cost.per_row(1) == pytest.approx(0.2, rel=1e-9)
    for _ in range(5):  # steps of 2 more rows now faster: the median follows
        cost.observe(1, 2, 0.012)
    assert cost.per_row(1) == pytest.approx(0.1, rel=1e-9)
    assert [worth(0.5, k, 0.2) for k in (1, 2, 4)] == [1, 2, 2]
    assert worth(0.1, 4, 0.2) == 0 and StepCost(0.3).per_row(1) == 0.3
    model = _tiny()
    ref = Engine(model).generate([[1, 2, 3]], SamplingParams(max_tokens=64))[0].tokens
    counts = []
    for row_cost in (0.0, 1.01):
        spec = Oracle({(1, 2, 3): ref}, tokens=4, row_cost=row_cost)
        got = Engine(model, speculator=spec).generate([[1, 2, 3]],
                                                      SamplingParams(max_tokens=64))
        assert got[0].tokens == ref
        counts.append((spec.proposed, spec.accepted))
    (free, _), (dear, dear_accepted) = counts
    assert 0 < dear < free / 2, counts  # probes of one token: 1 after 1, 2, 4.. steps
    assert dear_accepted > 0


class Logged(Oracle):
    """An Oracle that keeps the length of each proposal it makes."""

    def propose(self, decodes, spare, room):
        drafts = super().propose(decodes, spare, room)
        self.made = getattr(self, "made", []) + [len(d) for d in drafts.values()]
        return drafts


def test_lookups_not_proposed_teach_the_rate():
    """A sequence proposes only after one of its lookups was scored for free: where the
    lookups copy (the reference, all right) its first proposal has more tokens than the
    prior pays for at a row cost of 0.3; where they fail (first token wrong) at a cost
    above what one failure leaves of the prior (0.45 < 0.48), it never proposes."""
    model = _tiny()
    ref = Engine(model).generate([[1, 2, 3]], SamplingParams(max_tokens=40))[0].tokens
    right = Logged({(1, 2, 3): ref}, tokens=4, row_cost=0.3)
    right.rng.random = lambda: 1.0  # never made wrong
    wrong = Logged({(1, 2, 3): ref}, tokens=4, wrong=True, row_cost=0.48)
    for spec in (right, wrong):
        got = Engine(model, speculator=spec).generate([[1, 2, 3]],
                                                      SamplingParams(max_tokens=40))
        assert got[0].tokens == ref
    assert right.made[0] > worth(PRIOR, 4, 0.3), right.made
    assert right.accepted == right.proposed > 0
    assert wrong.proposed == 0 and not getattr(wrong, "made", None)


def test_sampling_draws_the_same_tokens_and_accepts_at_the_models_rate():
    """Sampled requests (temperature 0.8, top-p 0.9): with proposals (the reference
    tokens, half with one wrong) a seed draws the same tokens and log-probabilities as
    without (the rejection rule for a one-token proposal is the draw itself). Then the
    rule's rate: 96 seeds at temperature 1, each proposing its likeliest second token
    d (looked up without speculation, same seed: same first token, same logits); the
    number accepted must match the sum of the model's p(d) within 3.29 standard
    deviations (a false alarm once in 1000 runs, normal approximation; p(d) here 0.2-0.9)."""
    model = _tiny()
    prompts = [PROMPTS[0], PROMPTS[2]]
    sampled = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=s, logprobs=1)
               for s in (4, 5)]
    want = Engine(model).generate(prompts, sampled)
    spec = Oracle({tuple(p): r.tokens for p, r in zip(prompts, want)})
    got = Engine(model, speculator=spec).generate(prompts, sampled)
    assert [(r.tokens, r.logprobs, r.top) for r in got] == \
        [(r.tokens, r.logprobs, r.top) for r in want]
    assert 0 < spec.accepted < spec.proposed
    seeds = range(96)
    free = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, logprobs=1) for s in seeds]
    base = Engine(model, max_batch=4).generate([[1, 2, 3]] * len(free), free)
    likeliest = {s: r.top[1][0] for s, r in zip(seeds, base)}  # (d, log p(d)) at token 2
    asked = []

    class Likeliest(Speculator):
        def lookup(self, st, req, k):
            asked.append(req.params.seed)
            return [likeliest[req.params.seed][0]]

    spec, engine = Likeliest(1, row_cost=0.0), Engine(model, max_batch=4)
    engine.speculator = engine.scheduler.speculator = spec
    for i in range(0, len(free), 4):  # 4 at once: their decodes in one step, no prompt
        engine.generate([[1, 2, 3]] * 4, free[i:i + 4])
    p = torch.tensor([likeliest[s][1] for s in asked]).exp()
    assert spec.proposed == len(asked) == len(free)
    z = (spec.accepted - p.sum()) / (p * (1 - p)).sum().sqrt()
    assert abs(z) < 3.29, (spec.accepted, p.sum(), z)


def test_generate_cli_prints_the_acceptance_rate(tmp_path, capsys):
    mesh = ParallelMesh.single()
    model = Transformer(CONFIG, mesh)
    fill(model, random_full(CONFIG, seed=5, scale=1.0), mesh)
    ckpt.save(tmp_path, model, mesh=mesh)
    ids = ",".join(map(str, SHARED * 2))
    outs = []
    for spec in ([], ["--speculative", "ngram", "--speculative-tokens", "3"]):
        assert run(generate_args("--checkpoint", str(tmp_path), "--prompt-ids", ids,
                                 "--max-new-tokens", "24", *spec)) == 0
        outs.append(capsys.readouterr())
    assert outs[0].out == outs[1].out  # the same tokens
    assert "speculative" not in outs[0].err
    assert " proposed token" in outs[1].err and " accepted" in outs[1].err
    with pytest.raises(UserError, match=r"--speculative-tokens=9 must be in \[1, 7\]"):
        run(generate_args("--checkpoint", str(tmp_path), "--prompt-ids", ids,
                          "--speculative", "ngram", "--speculative-tokens", "9"))
    with pytest.raises(UserError, match="--speculative-tokens=3 needs --speculative"):
        run(generate_args("--checkpoint", str(tmp_path), "--prompt-ids", ids,
                          "--speculative-tokens", "3"))
