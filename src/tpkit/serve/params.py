"""What a request asks for: `SamplingParams` (checked once, as it arrives), and the text
side of stopping, `StopText` (stop strings found in the decoded text, held back while
they might still be forming).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tpkit.spec.errors import UserError

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens new tokens at most; greedy at temperature 0, else sampled with top-k
    (0: off), top-p (1: off) and a seed (None: a fresh one); generation ends at the first
    `stop` string (not included in the text) or end-of-sequence token unless
    `ignore_eos`. `logprobs`: None, or k: each chosen token's log-probability under the
    model (before temperature) and the k likeliest tokens' (0 <= k <= 20); with `echo`,
    the prompt's tokens' too."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    echo: bool = False

    def __post_init__(self) -> None:
        bad = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad.append(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not _number(self.temperature) or not 0 <= self.temperature <= 100:
            bad.append(f"temperature={self.temperature!r} must be a number in [0, 100]")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            bad.append(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad.append(f"top_k={self.top_k!r} must be an integer >= 0 (0: off)")
        if self.seed is not None and not isinstance(self.seed, int):
            bad.append(f"seed={self.seed!r} must be an integer")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(
                self.logprobs, bool) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad.append(f"logprobs={self.logprobs!r} must be an integer in [0, {MAX_LOGPROBS}]")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad.append(f"stop={list(self.stop)!r} must be non-empty strings")
        if bad:
            raise UserError("; ".join(bad))


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class StopText:
    """The text generated so far, and how much of it may be shown: with stop strings,
    the last (longest stop - 1) characters wait, since they may begin a stop string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop, self.text, self.shown = stop, "", 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, piece: str) -> tuple[str, bool]:
        """New text -> (text now safe to show, whether a stop string was reached)."""
        start = max(0, len(self.text) - self.hold)  # a stop may straddle the old end
        self.text += piece
        cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return self._release(len(self.text)), True
        return self._release(max(self.shown, len(self.text) - self.hold)), False

    def flush(self) -> str:
        """The held-back text, at the end of generation."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out, self.shown = self.text[self.shown:upto], max(self.shown, upto)
        return out
