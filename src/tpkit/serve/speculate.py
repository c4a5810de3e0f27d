"""N-gram (prompt lookup) speculative decoding for the engine (a draft model's proposals,
verified the same way: `serve.draft`):

    spec = Speculator(tokens=4)                     # Engine(..., speculator=spec)
    drafts = spec.propose(decodes, spare, room)     # the scheduler, for a decode step
    why = spec.accept(req, draft, rows, give)       # the engine, after the forward

Propose: the k tokens that followed the latest earlier occurrence of the sequence's last
n tokens (n = 4, 3, 2, longest first) in its prompt + output. Verify: the sequence's last
token and its k proposed ones are k + 1 decode rows of one forward, each at its own
position on the sequence's block table (`paged_kv.layout`: every row's keys and values
are written before any row attends, each row reads the keys up to its own position), so
row i is computed exactly as the decode step of position start + i would be: the same
native kernels, whose every product row is summed in a fixed order whatever the other
rows (`kernels.decode_ops`: batch invariant by construction). The tokens are then taken
row by row as without speculation (`give`: the greedy token, or `OutputProcessor.take`
with its penalties, sampling, log-probabilities and stop strings) while each one equals
the proposed token that the next row assumed; the first that differs is the last taken
(the "bonus" token). The KV rows past it are rolled back (`Scheduler.rolled_back`: the
blocks past the tokens kept are freed; decode tokens never enter the prefix cache).

Sampling: for a proposal that is one token d (a point mass, as every n-gram proposal),
the standard rejection rule (accept d with probability min(1, p(d) / q(d)) = p(d), else
draw from (p - q)+ normalized = p without d) is the same as drawing t from p and keeping
it, accepting d if t == d: that is what `give` does, row by row, with the request's own
generator, one draw per token kept as without speculation. So a seeded request draws
the same tokens with or without speculation, its logits being the same bits.

Exactness: a step of speculation has decode rows only and at most `decode_ops.ROWS`
rows in all (default mode), so it stays on the native kernels whose rows do not depend
on the batch; in the batch-invariant mode the proposed rows only fill the padding rows
of the C-row forwards the decodes take anyway. Not speculated: a request with a grammar
(structured outputs: its matcher would have to step back).

Adaptive, per sequence: `k` starts at `tokens`; a fully accepted proposal raises it by
one (up to `tokens`), a rejected first token halves it; at 0 the sequence rests for
`rest` steps (doubling at each failure, up to REST_MAX) and then probes one token. A
proposal is made only where the n-gram matches (nothing to look up costs nothing).

Free evidence (`_score`): a sequence that does not propose (resting, or no token pays)
still looks up, and once the tokens it would have proposed are decoded (or one differs)
that lookup moves its rate as a proposal's would, at no row's cost; all of it right
ends a rest. Where rows cost anything, a sequence's first proposal waits for one such
scored lookup: an ungrounded answer (whose lookups fail) starts with none, a grounded
one (whose lookups copy) with its rate already up, so with K tokens rather than one.

Cost-aware (the never-lose rule): a proposal's i-th token is accepted with chance about
a^i (a: the sequence's chance that a proposed token is accepted, a moving average over
the tokens tried, the accepted ones and the first rejected, from PRIOR) and costs one
more row of the step; rows are not free (a bfloat16 step of a few rows costs more than
its one-row step on a CPU). So a sequence proposes only its first n tokens with a^i >=
c (each one expected to pay for its row; `worth`), c the measured cost of a row as a
fraction of the step without it (`StepCost`: the engine's wall times of decode-only
steps, per number of decode rows, medians of the last steps; ROW_COST until
measured). Where not even one token pays, the sequence proposes nothing and learns from
its lookups; if its rate is LOADED_RATE or more it also rests and then probes one token
whatever it costs (the cost, measured again: it may be stale).
Under load, the step's spare rows go first to the sequences whose acceptance rate
(EWMA) is highest, and with more than one sequence running only to those above
`LOADED_RATE`: at 8 running sequences there is no spare row and nobody pays.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from tpkit.spec.speculative import TOKENS, check

SIZES = (4, 3, 2)  # n-gram lengths looked up, longest first
REST_MAX = 64  # steps a sequence rests at most after its proposals failed
LOADED_RATE = 0.5  # with several sequences running, the acceptance a proposer needs
PRIOR = 0.5  # a new sequence's acceptance, before any proposal of its own
ROW_COST = 0.1  # a verify row's cost in steps until `StepCost` has measured it
WINDOW = 15  # steps of each shape whose times `StepCost` keeps
LEARN = 0.1  # weight of a token tried in a sequence's acceptance rate


@dataclass
class _State:
    """A sequence's n-gram index and its speculation's state."""

    k: int
    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end
    indexed: int = 0  # context positions whose n-grams ending there are in `index`
    rate: float = PRIOR  # a proposed token's chance of acceptance (EWMA per token tried)
    rest: int = 0  # steps to wait before proposing again
    backoff: int = 1  # the next rest
    probe: bool = False  # after a rest: one token proposed (if one pays)
    shadow: tuple[int, list[int]] | None = None  # (tokens then, lookup not proposed)
    scored: bool = False  # whether a lookup of its own was scored yet (`_score`)


def worth(rate: float, k: int, cost: float) -> int:
    """How many of k tokens to propose: the first n whose chance of being accepted
    (rate^i for the i-th) is at least `cost`, a row's cost in steps."""
    n = 0
    while n < k and rate ** (n + 1) >= cost:
        n += 1
    return n


class StepCost:
    """A verify row's cost as a fraction of the decode-only step without it, measured
    (per number of decode rows: the median of the last WINDOW step times of each number
    of extra rows against the steps without, (median / that - 1) / extra, averaged over
    the numbers of extra rows by their steps); `fixed`: that cost, unmeasured. Medians,
    not moving averages: one step slowed by the machine (measured at up to a second on
    a loaded one) would set a row's cost above a step's, stop every proposal, and so
    never be measured again."""

    def __init__(self, fixed: float | None = None) -> None:
        self.fixed = fixed
        self.times: dict[tuple[int, int], deque[float]] = {}  # (decode, extra rows) -> s

    def observe(self, decodes: int, extra: int, seconds: float) -> None:
        """A decode-only step of `decodes` rows and `extra` verify rows took `seconds`
        (each shape's first step, a first call's warm-up, not counted)."""
        kept = self.times.get((decodes, extra))
        if kept is None:
            self.times[(decodes, extra)] = deque(maxlen=WINDOW)
        else:
            kept.append(seconds)

    def per_row(self, decodes: int) -> float:
        """What one more row costs a step of `decodes` decode rows, in steps."""
        if self.fixed is not None:
            return self.fixed
        plain = self.times.get((decodes, 0))
        rows = [(e, t) for (d, e), t in self.times.items() if d == decodes and e and t]
        if not plain or not rows:
            return ROW_COST
        base = median(plain)
        got = sum((median(t) / base - 1) / e * len(t) for e, t in rows)
        return max(0.0, got / sum(len(t) for _, t in rows))


def lookup(st: _State, ctx: list[int], k: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of ctx's last n tokens (n of
    SIZES, longest first), [] if none; the index is brought up to ctx first."""
    end = len(ctx)
    for e in range(max(st.indexed, 1), end):  # n-grams ending before the last position
        for n in SIZES:
            if e >= n:
                st.index[(n, *ctx[e - n:e])] = e
    st.indexed = max(st.indexed, end)
    for n in SIZES:
        if end > n:
            at = st.index.get((n, *ctx[end - n:]))
            if at is not None:
                return ctx[at:at + k]
    return []


class Speculator:
    """The engine's n-gram proposer and verifier, and its counts (`/metrics`)."""

    free_lookups = True  # a lookup costs nothing (an n-gram's): one not proposed is scored

    def __init__(self, tokens: int = TOKENS, rows: int = 8,
                 row_cost: float | None = None) -> None:
        check(None, tokens)
        self.tokens, self.rows = tokens, rows
        self.cost = StepCost(row_cost)  # the engine's `observe`s (fixed: `row_cost`)
        self.proposed = self.accepted = 0  # tokens proposed / accepted (metrics)
        self.states: dict[int, _State] = {}  # request id -> its state

    @staticmethod
    def eligible(req) -> bool:
        """Whether `req`'s tokens may be verified in rows (no grammar)."""
        return req.params.grammar is None

    def propose(self, decodes: list, spare: int, room) -> dict[int, list[int]]:
        """Request id -> its proposed tokens, for `decodes` (requests decoding one token
        this step) within `spare` extra rows; `room(req, tokens)`: how many of its
        tokens' KV its blocks can hold (the scheduler's, never preempting)."""
        alive = {r.id for r in decodes}
        for rid in [i for i in self.states if i not in alive]:
            del self.states[rid]  # finished (or preempted: its state starts again)
        wants, cost = [], self.cost.per_row(len(decodes))
        for req in decodes:
            st = self.states.setdefault(req.id, _State(self.tokens))
            if not self.eligible(req):
                continue
            _score(st, req.tokens)
            k = _wanted(st, req.params.max_tokens - len(req.tokens) - 1, cost)
            if k > 0:
                wants.append((st.rate, req, st, k))
            elif self.free_lookups and st.shadow is None and \
                    len(req.tokens) < req.params.max_tokens - 1:
                draft = self.lookup(st, req, self.tokens)  # not proposed: looked up anyway
                st.shadow = (len(req.tokens), draft) if draft else None
        if len(decodes) > 1:
            wants = [w for w in wants if w[0] >= LOADED_RATE]
        drafts = {}
        for _, req, st, k in sorted(wants, key=lambda w: -w[0]):
            draft = self.lookup(st, req, min(k, spare)) if spare > 0 else []
            if draft:  # blocks for its rows, only now (none taken for nothing)
                fits = room(req, req.computed + 1 + len(draft)) - req.computed - 1
                draft = draft[:max(0, fits)]
            if draft:
                drafts[req.id], spare = draft, spare - len(draft)
                st.probe = False
        return drafts

    def observe(self, out, seconds: float) -> None:
        """The engine: a decode-only step (its `SchedulerOutput`) took `seconds` to the
        end of its forward (the tokens' delivery after it is paid with or without
        rows: counted, a step that delivers 5 tokens would charge 4 to its rows)."""
        self.cost.observe(out.decodes, sum(map(len, out.drafts.values())), seconds)

    def lookup(self, st: _State, req, k: int) -> list[int]:
        """At most k tokens proposed to follow `req`'s (`lookup` on its prompt + output)."""
        return lookup(st, req.prompt + req.tokens, k)

    def accept(self, req, draft: list[int], rows: list, give) -> str | None:
        """Take `req`'s tokens from its verify rows (one per proposed token, and one
        more) while each equals the proposed token after it; `give(row)` takes one (why
        the request ends, or None). Why it ends, or None."""
        st = self.states.get(req.id)
        taken, why = 0, None
        for i, row in enumerate(rows):
            why = give(row)
            if why is not None or i == len(draft) or req.tokens[-1] != draft[i]:
                break
            taken += 1
        self.proposed, self.accepted = self.proposed + len(draft), self.accepted + taken
        if st is not None:
            _adapt(st, taken, len(draft), self.tokens)
        return why


def _wanted(st: _State, left: int, cost: float) -> int:
    """How many tokens a sequence proposes this step, `left` before its last token (0:
    none; a rest counted down; where rows cost, none before a scored lookup)."""
    if st.rest > 0:
        st.rest -= 1
        return 0
    if not st.scored and cost > 0:
        return 0
    if st.probe and st.rate >= LOADED_RATE:  # likely accepted: one token, whatever the
        return max(0, min(1, left))  # cost (which this step measures again: it may be stale)
    n = min(worth(st.rate, 1 if st.probe else st.k, cost), left)
    if n <= 0 < left and st.rate >= LOADED_RATE:
        _rest(st)  # likely accepted, yet no token pays: rest, then probe one
    return max(0, n)


def _adapt(st: _State, taken: int, proposed: int, most: int) -> None:
    """A sequence's k and rest after `taken` of its `proposed` tokens were accepted."""
    _learn(st, taken, proposed)
    if taken == proposed:
        st.k, st.backoff = min(most, st.k + 1), 1
    elif taken == 0:
        st.k //= 2
        if st.k == 0:
            _rest(st)
            st.k = 1


def _learn(st: _State, taken: int, proposed: int) -> None:
    """The rate after `taken` of `proposed` tokens were accepted: each token tried (the
    taken ones and the first rejected) moves it by LEARN towards 1 or 0."""
    for hit in [1.0] * taken + [0.0] * (taken < proposed):
        st.rate += LEARN * (hit - st.rate)


def _score(st: _State, tokens: list[int]) -> None:
    """A lookup not proposed (`_State.shadow`), once the tokens it would have proposed
    are known or one differs: its outcome moves the rate as a proposal's would (free
    evidence); all of it right ends a rest."""
    if st.shadow is None:
        return
    at, draft = st.shadow
    got = tokens[at:at + len(draft)]
    taken = 0
    while taken < len(got) and got[taken] == draft[taken]:
        taken += 1
    if taken == len(got) < len(draft):
        return  # every token so far right: not known yet
    st.shadow, st.scored = None, True
    _learn(st, taken, len(draft))
    if taken == len(draft):
        st.rest, st.backoff = 0, 1


def _rest(st: _State) -> None:
    """The sequence rests `backoff` steps (doubled for the next time), then probes."""
    st.rest, st.backoff, st.probe = st.backoff, min(REST_MAX, 2 * st.backoff), True
