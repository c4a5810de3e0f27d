"""The prompt budget that keeps the decoding streams' inter-token latency near a
decode-only step's (`serve.pacing`, `Scheduler.schedule(prompt_budget)`).

Checked, with no clock: given a budget of N tokens, a step computes at most N prompt
tokens while a request decodes (never fewer than FLOOR, never more than
prefill_per_step, none for 0; one budget shared by the prompts of a step), a lone
prompt gets the whole prefill_per_step (its prompt's blocks taken at once, adjacent),
and the batch-invariant mode's pieces ignore it; the pacer, fed the times of a known cost model, learns it, ramps from the floor by
doubling, and then keeps every step of a 4k-token prompt within the ratio, also when
the machine gets busier mid-prompt (a decode-only step every REFRESH steps); the engine computes the
pieces its pacer allows, and each request's greedy tokens are those it gets alone;
/metrics (prometheus_client's parser) shows the pacer's ratio, budget and costs.
"""

from __future__ import annotations

import time

import pytest

from checkpoint_helpers import LLAMA, fill, random_full
from tpkit.decode.paged_kv import NONE
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.serve import Engine, SamplingParams
from tpkit.serve.blocks import BlockPool
from tpkit.serve.pacing import REFRESH, Pacer
from tpkit.serve.request import Request
from tpkit.serve.scheduler import FLOOR, Scheduler
from tpkit.serve.sequence import Seq
from tpkit.spec.errors import UserError

PER_STEP = 64


def _scheduler(chunk: int | None = None) -> Scheduler:
    return Scheduler(BlockPool(16, 200), max_batch=4, max_tokens_in_flight=10**6,
                     prefill_per_step=PER_STEP, chunk=chunk, piece=32)


def _request(rid: int, n: int) -> Seq:
    return Seq(Request(rid, [(rid * 31 + i) % 97 for i in range(n)],
                       SamplingParams(max_tokens=500, ignore_eos=True)))


def _step(sched: Scheduler, budget: int | None):
    """One step as the engine runs it, minus the forward: a token for each request whose
    piece ends its tokens."""
    out = sched.schedule(budget)
    sched.computed(out)
    for fwd in out.forwards:
        for piece, req in zip(fwd.pieces, fwd.reqs):
            if req is not None and piece.logits != NONE:
                req.tokens.append(1)
    return out


def test_a_step_computes_what_the_budget_allows_while_requests_decode():
    sched = _scheduler()
    lone = _request(1, 150)
    sched.waiting.append(lone)
    assert sched.prompt_start() == 0
    out = _step(sched, 5)  # nothing decodes: the whole prefill_per_step
    assert (out.decodes, out.prefill) == (0, [(0, PER_STEP)])
    assert sched.prompt_start() == PER_STEP
    _step(sched, 5)
    _step(sched, 5)  # 64 + 64 + 22: the prompt is computed, it decodes from now on
    assert sched.prompt_start() is None
    long = _request(2, 400)
    sched.waiting.append(long)
    budgets, start = [0, 7, 30, 1000, 1, 64, 10**6, 13], 0
    for budget in budgets * 3:
        if start == len(long.prompt):
            break
        assert sched.prompt_start() == start
        out = _step(sched, budget)
        n = min(len(long.prompt) - start, PER_STEP, max(budget, FLOOR)) if budget else 0
        assert (out.decodes, out.prefill, out.prompt_tokens) == \
            (1, [(start, n)] if n else [], n)  # 0: a decode-only step
        start += n
    assert start == len(long.prompt) and long.tokens == [1]  # its first token came
    first = long.blocks[0]  # its prompt's 25 blocks, taken at once while the other's grew:
    assert long.blocks[:25] == list(range(first, first + 25))  # adjacent, read in place
    short = [_request(3, 30), _request(4, 30)]
    sched.waiting.extend(short)
    out = _step(sched, 40)  # one budget for the step: 30 of one, 10 of the next
    assert (out.decodes, out.prefill) == (2, [(0, 30), (0, 10)])


def test_the_batch_invariant_pieces_ignore_the_budget():
    sched = _scheduler(chunk=2)
    first = _request(1, 10)
    sched.waiting.append(first)
    _step(sched, None)
    sched.waiting.append(_request(2, 100))
    pieces = [_step(sched, FLOOR).prefill for _ in range(4)]
    assert pieces == [[(0, 32)], [(32, 32)], [(64, 32)], [(96, 4)]]


D, A, B, G = 0.080, 0.0024, 0.0013, 0.004  # a decode-only step; s per prompt token, per
# token per 1k positions, per 1k keys read (this CPU's order, SmolLM2-135M's shapes)


def _cost(start: int, n: int) -> float:
    return D + A * n + B * n * (start + (n - 1) / 2) / 1024 + G * (start + n) / 1024


def _walk(pacer: Pacer, slower_from: int = 1 << 30) -> list[tuple[int, float, float]]:
    """A 4096-token prompt computed as the engine would with `pacer` (8 streams
    decoding): (prompt tokens, seconds, the machine's slowness) of each step; from
    context position `slower_from` every step takes twice as long (a busier machine)."""
    start, steps = 0, []
    while start < 4096:
        k = 2.0 if start >= slower_from else 1.0
        n = pacer.budget(start)
        if n > 0:  # else a decode-only step (D measured again)
            n = min(4096 - start, max(FLOOR, n))
        t = k * _cost(start, n) if n else k * D
        pacer.observe(t, 8, [(start, n)] if n else [])
        steps.append((n, t, k))
        start += n
    return steps


def test_the_pacer_learns_a_cost_model_and_keeps_each_step_within_the_ratio():
    pacer = Pacer(1.5)
    pacer.observe(9.0, 0, [(0, 256)])  # a lone prompt: no stream to compare with
    assert pacer.budget(0) == 0 and pacer.decode_s is None  # a decode-only step first
    pacer.observe(D, 8, [])
    assert pacer.budget(0) == 1  # no piece seen yet: the floor
    pacer.observe(2 * D, 8, [])
    assert pacer.decode_s == pytest.approx(1.2 * D)  # a moving average
    for _ in range(40):
        pacer.observe(D, 8, [])
    assert pacer.decode_s == pytest.approx(D, rel=1e-3)
    steps = _walk(pacer)
    sizes = [n for n, _, _ in steps if n]
    assert sizes[:3] == [FLOOR, 2 * FLOOR, 4 * FLOOR]  # doubling from the floor
    runs = "".join("p" if n else "d" for n, _, _ in steps).split("d")
    assert max(map(len, runs)) == REFRESH  # D measured again every REFRESH steps
    room = 1.5 * D
    late = [t for n, t, _ in steps[3:] if n > FLOOR]
    assert len(late) > 20 and max(late) <= room * 1.01  # within the ratio
    assert min(late[1:len(late) // 2]) > room * 0.9  # and not needlessly small pieces
    assert sizes[-2] < sizes[4]  # attention's growth: pieces shrink with the context


def test_a_busier_machine_is_seen_by_measuring_the_decode_only_step_again():
    pacer = Pacer(1.5)
    for _ in range(40):
        pacer.observe(D, 8, [])
    steps = _walk(pacer, slower_from=1024)
    change = next(i for i, (_, _, k) in enumerate(steps) if k > 1)  # its first two steps
    late = [(t, k) for n, t, k in steps[3:change] + steps[change + 2:]  # are planned with
            if n > FLOOR]  # the quieter machine's figures
    assert all(t <= 1.5 * k * D * 1.01 for t, k in late)  # within the ratio throughout
    assert pacer.decode_s == pytest.approx(2 * D, rel=0.05)


def test_the_pacer_fits_its_three_costs_from_varied_steps():
    pacer = Pacer(1.5)
    pacer.observe(D, 8, [])
    for i in range(30):  # pieces of every size at every context
        start, n = (i * 1237) % 4000, 1 + (i * 37) % 200
        pacer.observe(_cost(start, n), 8, [(start, n)])
    assert pacer.costs() == pytest.approx((A, B, G), rel=1e-3)
    pacer.observe(D, 8, [(0, 300)])  # quicker than a decode-only step: no term below 0
    assert min(pacer.costs()) >= 0


def test_a_ratio_must_be_above_one_or_zero():
    for bad in (1.0, 0.5, -2.0, float("nan"), float("inf")):
        with pytest.raises(UserError, match="itl_ratio=.* must be > 1"):
            Pacer(bad)


def _model():
    mesh = ParallelMesh.single()
    config = LLAMA.with_(max_seq_len=256)
    model = Transformer(config, mesh)
    fill(model, random_full(config, seed=5, scale=1.0), mesh)
    return model


class _Fixed(Pacer):
    """A budget source of N tokens a step."""

    def __init__(self, n: int) -> None:
        super().__init__(1.5)
        self.n, self.starts = n, []

    def budget(self, start: int) -> int:
        self.starts.append(start)
        return self.n

    def observe(self, *args) -> None:
        pass


def test_the_engine_computes_the_pieces_its_pacer_allows_and_tokens_stay_exact():
    model = _model()
    short, long = [3, 4, 5], list(range(1, 41))
    alone = [Engine(model, max_batch=4, max_len=96).generate([p], SamplingParams(
        max_tokens=n, ignore_eos=True))[0].tokens for p, n in ((short, 12), (long, 3))]
    for pacer in (_Fixed(8), None):
        engine = Engine(model, max_batch=4, max_len=96, prefill_per_step=16, itl_ratio=1.5)
        assert isinstance(engine.pacer, Pacer)
        if pacer is not None:
            engine.pacer = pacer
        rows = []
        hook = model.embed.register_forward_pre_hook(  # ids [T, 1]: T rows a forward
            lambda m, a, rows=rows: rows.append(a[0].shape[0]))
        first = engine.submit(short, SamplingParams(max_tokens=12, ignore_eos=True))
        engine.step()
        second = engine.submit(long, SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.busy:
            engine.step()
        hook.remove()
        assert [first.tokens, second.tokens] == alone
        if pacer is not None:  # 8 prompt tokens + 1 decode a step: 40 = 5 x 8 (asked with
            # the position of the next piece; the first step: the short prompt's 0)
            assert rows[:7] == [3, 9, 9, 9, 9, 9, 2] and pacer.starts[:6] == [0, 0, 8, 16, 24, 32]
        else:  # the real pacer: it measured the decode-only steps
            assert engine.pacer.decode_s is not None
    assert Engine(model, max_batch=4, max_len=96, decode_chunk=2, itl_ratio=1.5).pacer is None
    assert Engine(model, max_batch=4, max_len=96).pacer is None  # off unless asked


def test_metrics_show_the_pacers_budget_and_costs(chat_llama, serve_in_threads):
    """Served with --itl-ratio 1.5: two streams decode while a 90-token prompt arrives;
    /metrics, read by prometheus_client's parser, shows the ratio, the budget the pacer
    gave the last step with a prompt (the last it answered) and its decode-only step
    time and costs, as the pacer holds them."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    from tpkit.weights.sources import load_model
    from tpkit.weights.tokenizer import load_tokenizer

    model = load_model(chat_llama, ParallelMesh.single())
    engine = Engine(model, max_batch=4, max_len=128, itl_ratio=1.5)
    answers, budget = [], engine.pacer.budget
    engine.pacer.budget = lambda start: answers.append(budget(start)) or answers[-1]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with serve_in_threads(engine, "llama", load_tokenizer(chat_llama)) as (url, _, _):
        streams = [engine.submit([5 + i, 6, 7], params) for i in range(2)]
        while min(len(r.tokens) for r in streams) < 3:
            time.sleep(0.01)
        long = engine.submit([(3 * i) % 50 + 4 for i in range(90)], params)
        for r in [*streams, long]:
            list(r)  # until it ends
        deadline = time.monotonic() + 30
        while engine.metrics.batch_size and time.monotonic() < deadline:
            time.sleep(0.01)  # the last step's accounting (after its requests ended)
        fams = {f.name: f for f in text_string_to_metric_families(
            urlopen(url + "/metrics").read().decode())}
    got = lambda name: [s.value for s in fams[name].samples]  # noqa: E731
    pacer = engine.pacer
    assert got("tpkit_pacing_itl_ratio") == [1.5]
    assert got("tpkit_pacing_prompt_budget_tokens") == [answers[-1]]
    assert got("tpkit_pacing_decode_step_seconds") == [pacer.decode_s] and pacer.decode_s > 0
    costs = {s.labels["term"]: s.value for s in fams["tpkit_pacing_cost_seconds"].samples}
    assert costs == dict(zip(("token", "token_kpos", "kkeys"), pacer.costs()))
    assert pacer.largest > 0  # it saw steps with pieces and decodes: costs were fitted
