"""How many prompt tokens a step may carry while requests decode, so that the running
streams' inter-token latency (ITL) stays within `ratio` x a decode-only step's.

The default (not batch-invariant) engine computes the decodes and pieces of prompts in
one forward (chunked prefill). Every prompt token such a step carries makes it longer
for every stream that is decoding: on a CPU a 256-token piece costs several decode
steps. `Pacer` learns what steps cost from the wall times the engine hands it
(`observe`, after each step) and answers, before each step, the prompt tokens that keep
the predicted step within `ratio` x a decode-only step (`budget`):

    decode-only step      D                            an average of the last ones
    a step with pieces    D + a * p + b * p * m / 1024 p prompt tokens at mean context
                                                       position m (attention's growth)
    budget(start)         the largest p with a * p + b * p * (start + (p - 1) / 2) / 1024
                          <= (ratio - 1) * D

a and b are a least-squares fit of the steps with pieces and decodes (the time above D),
recent steps weighted more (exponential forgetting), each kept >= 0. Until D and a first
piece are known the budget is 0 (the scheduler's floor, `scheduler.FLOOR`); it grows
at most to twice the largest piece seen so far (a noisy early fit never buys one huge
step). What it trades: a long prompt's time to first token, spread over more steps,
for the other streams' ITL (`--itl-ratio`).

No clock here: the engine measures, the scheduler receives a number.
"""

from __future__ import annotations

import math

from tpkit.spec.errors import UserError

ITL_RATIO = 1.5  # a step with pieces of prompts at most 1.5 x a decode-only step
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
        self.sums = [0.0] * 5  # forgotten sums of x1x1, x1x2, x2x2, x1y, x2y
        self.largest = 0  # prompt tokens of the largest step with pieces and decodes seen

    def observe(self, seconds: float, decodes: int, pieces: list[tuple[int, int]]) -> None:
        """A step ran in `seconds` with `decodes` decoding requests and `pieces`
        (start, tokens) of prompts. Steps without decodes teach nothing (a lone prompt
        has no stream to protect and no decode-only step to compare with)."""
        if decodes == 0:
            return
        if not pieces:
            d = self.decode_s
            self.decode_s = seconds if d is None else d + self.smoothing * (seconds - d)
            return
        if self.decode_s is None:
            return
        x1 = sum(n for _, n in pieces)
        x2 = sum(n * (start + (n - 1) / 2) for start, n in pieces) / KILO
        y = seconds - self.decode_s
        s = [v * self.forget for v in self.sums]
        self.sums = [s[0] + x1 * x1, s[1] + x1 * x2, s[2] + x2 * x2, s[3] + x1 * y,
                     s[4] + x2 * y]
        self.largest = max(self.largest, x1)

    def costs(self) -> tuple[float, float]:
        """(a, b): seconds per prompt token, and per prompt token per 1024 positions of
        context; each >= 0."""
        s11, s12, s22, s1y, s2y = self.sums
        if s11 <= 0:
            return 0.0, 0.0
        det = s11 * s22 - s12 * s12
        if det > 1e-9 * s11 * s22:
            a, b = (s22 * s1y - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det
            if a >= 0 and b >= 0:
                return a, b
            if a < 0 and s22 > 0:  # the context term alone
                return 0.0, max(0.0, s2y / s22)
        return max(0.0, s1y / s11), 0.0  # the per-token term alone

    def budget(self, start: int) -> int:
        """Prompt tokens the next step may compute, its first piece starting at context
        position `start` (0: nothing known yet, the scheduler's floor applies)."""
        if self.decode_s is None or self.largest == 0:
            return 0
        cap = 2 * self.largest
        a, b = self.costs()
        room = (self.ratio - 1) * self.decode_s
        # a p + b p (start + (p - 1) / 2) / K <= room:  A p^2 + B p - room <= 0
        big_a, big_b = b / (2 * KILO), a + b * (start - 0.5) / KILO
        if big_a > 0:
            p = (-big_b + math.sqrt(big_b * big_b + 4 * big_a * room)) / (2 * big_a)
        elif big_b > 0:
            p = room / big_b
        else:
            return cap
        return max(0, min(cap, int(p)))
