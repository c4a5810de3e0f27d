"""How many prompt tokens a step may carry while requests decode, so that the running
streams' inter-token latency (ITL) stays within `ratio` x a decode-only step's.

The default (not batch-invariant) engine computes the decodes and pieces of prompts in
one forward (chunked prefill). Every prompt token such a step carries makes it longer
for every stream that is decoding: on a CPU a 256-token piece costs several decode
steps. `Pacer` learns what steps cost from the wall times the engine hands it
(`observe`, after each step) and answers, before each step, the prompt tokens that keep
the predicted step within `ratio` x a decode-only step (`budget`):

    decode-only step      D                          an average of the last ones
    a step with pieces    D + a p + b p m / K + g c / K   p prompt tokens at mean context
                                                     position m, c keys read (K = 1024)
    budget(start)         the largest p with a p + b p (start + (p - 1) / 2) / K
                          + g (start + p) / K <= (ratio - 1) D

a (the products), b (attention's growth with the context) and g (reading a piece's c
keys, whatever its rows: gathering its blocks, ~1/3 of a decode step at 4k keys for
SmolLM2-135M here) are a least-squares fit, each >= 0, of the steps with pieces and
decodes (the time above D), recent steps weighted more (exponential forgetting). Where
even the floor costs more than the room (g alone at a long context), the step is over
the ratio: nothing smaller progresses. D is measured again every `REFRESH` steps with
pieces (a budget of 0: that step computes no prompt token): on a shared machine the
decode-only step time moves, and a stale D would be read as the pieces' cost (the
engine hands over no step that grew the KV cache: that copy is no piece's cost). Until
a first piece is seen the budget is the scheduler's floor (`scheduler.FLOOR`); it
grows at most to twice the largest piece seen so far (a noisy early fit never buys one
huge step). What it trades: a long prompt's time to first token, spread over more steps,
for the other streams' ITL (`--itl-ratio`).

No clock here: the engine measures, the scheduler receives a number.
"""

from __future__ import annotations

import math

from tpkit.spec.errors import UserError

ITL_RATIO = 1.5  # a step with pieces of prompts at most 1.5 x a decode-only step
REFRESH = 8  # steps with pieces between two decode-only steps that measure D again
KILO = 1024  # context positions per unit of the attention term


def check_ratio(ratio: float, name: str = "itl_ratio") -> None:
    """UserError unless `ratio` is 0 (off: a fixed budget) or > 1."""
    if not (ratio == 0 or ratio > 1) or math.isnan(ratio) or math.isinf(ratio):
        raise UserError(f"{name}={ratio} must be > 1 (a step with prompt pieces at most "
                        f"that many decode-only steps) or 0 (off: --prefill-per-step alone)")


class Pacer:
    """Per-step prompt-token budget from measured step times (see the module's text)."""

    def __init__(self, ratio: float = ITL_RATIO, *, smoothing: float = 0.2,
                 forget: float = 0.9) -> None:
        check_ratio(ratio)
        self.ratio, self.smoothing, self.forget = ratio, smoothing, forget
        self.decode_s: float | None = None  # a decode-only step's seconds (moving average)
        self.xx = [[0.0] * 3 for _ in range(3)]  # forgotten sums of x x^T and x y,
        self.xy = [0.0] * 3  # x = (tokens, tokens x mean position / K, keys read / K)
        self.largest = 0  # prompt tokens of the largest step with pieces and decodes seen
        self.since = 0  # steps with pieces and decodes since the last decode-only one

    def observe(self, seconds: float, decodes: int, pieces: list[tuple[int, int]]) -> None:
        """A step ran in `seconds` with `decodes` decoding requests and `pieces`
        (start, tokens) of prompts. Steps without decodes teach nothing (a lone prompt
        has no stream to protect and no decode-only step to compare with)."""
        if decodes == 0:
            return
        if not pieces:
            d = self.decode_s
            self.decode_s = seconds if d is None else d + self.smoothing * (seconds - d)
            self.since = 0
            return
        self.since += 1
        if self.decode_s is None:
            return
        x = (sum(n for _, n in pieces),
             sum(n * (start + (n - 1) / 2) for start, n in pieces) / KILO,
             sum(start + n for start, n in pieces) / KILO)
        y = seconds - self.decode_s
        for i in range(3):
            self.xy[i] = self.forget * self.xy[i] + x[i] * y
            for j in range(3):
                self.xx[i][j] = self.forget * self.xx[i][j] + x[i] * x[j]
        self.largest = max(self.largest, x[0])

    def costs(self) -> tuple[float, float, float]:
        """(a, b, g): seconds per prompt token, per prompt token per K positions of its
        context, per K keys a piece reads; each >= 0 (a term fitted below 0 is dropped
        and the others fitted again)."""
        terms = [i for i in range(3) if self.xx[i][i] > 0]
        while terms:
            ridge = 1e-9 * max(self.xx[i][i] for i in terms)  # collinear terms: split
            got = _solve([[self.xx[i][j] + (ridge if i == j else 0.0) for j in terms]
                          for i in terms], [self.xy[i] for i in terms])
            worst = min(range(len(terms)), key=got.__getitem__)
            if got[worst] >= 0:
                out = [0.0] * 3
                for i, c in zip(terms, got):
                    out[i] = c
                return out[0], out[1], out[2]
            terms.pop(worst)
        return 0.0, 0.0, 0.0

    def budget(self, start: int) -> int:
        """Prompt tokens the next step may compute while requests decode, its first piece
        starting at context position `start`: 0 for a decode-only step (D unknown or due
        to be measured again), else >= 1 (the scheduler lifts it to its floor)."""
        if self.decode_s is None or self.since >= REFRESH:
            return 0
        if self.largest == 0:
            return 1  # the floor: the first piece
        cap = 2 * self.largest
        a, b, g = self.costs()
        room = (self.ratio - 1) * self.decode_s - g * start / KILO
        if room <= 0:
            return 1
        # a p + b p (start + (p - 1) / 2) / K + g p / K <= room:  A p^2 + B p - room <= 0
        big_a, big_b = b / (2 * KILO), a + (b * (start - 0.5) + g) / KILO
        if big_a > 0:
            p = (-big_b + math.sqrt(big_b * big_b + 4 * big_a * room)) / (2 * big_a)
        elif big_b > 0:
            p = room / big_b
        else:
            return cap
        return max(1, min(cap, int(p)))


def _solve(m: list[list[float]], v: list[float]) -> list[float]:
    """x with m x = v (Gaussian elimination, partial pivoting; m small and regular)."""
    n = len(v)
    rows = [list(r) + [b] for r, b in zip(m, v)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(rows[r][c]))
        rows[c], rows[pivot] = rows[pivot], rows[c]
        for r in range(c + 1, n):
            f = rows[r][c] / rows[c][c]
            rows[r] = [x - f * y for x, y in zip(rows[r], rows[c])]
    x = [0.0] * n
    for c in reversed(range(n)):
        x[c] = (rows[c][n] - sum(rows[c][k] * x[k] for k in range(c + 1, n))) / rows[c][c]
    return x
