"""What a request asks for: `SamplingParams` (checked once, as it arrives, by the one
rule `problem` that `tpkit generate`'s flags and the server's request schema share),
and the text side of stopping, `StopText` (stop strings found in the decoded text,
held back while they might still be forming).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from tpkit.decode.sampling import GREEDY_BELOW, TOP_P_MIN
from tpkit.spec.errors import UserError

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_TEMPERATURE = 100.0
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a 64-bit integer, as OpenAI's schema


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return (_int(x) or isinstance(x, float)) and math.isfinite(x)


# field -> (is the value good?, what it must be): the bounds of every sampling value
RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "max_tokens": (lambda x: x is None or _int(x) and x >= 1, "must be an integer >= 1"),
    "temperature": (lambda x: _number(x) and 0 <= x <= MAX_TEMPERATURE,
                    f"must be a number in [0, {MAX_TEMPERATURE:g}] (0, or below "
                    f"{GREEDY_BELOW:g}: greedy)"),
    "top_p": (lambda x: _number(x) and TOP_P_MIN <= x <= 1,
              f"must be a number in (0, 1] (at least {TOP_P_MIN:.2g}, float32's smallest)"),
    "top_k": (lambda x: _int(x) and x >= 0, "must be an integer >= 0 (0: off)"),
    "seed": (lambda x: x is None or _int(x) and SEED_MIN <= x <= SEED_MAX,
             "must be a 64-bit integer, in [-2^63, 2^63 - 1]"),
    "logprobs": (lambda x: x is None or _int(x) and 0 <= x <= MAX_LOGPROBS,
                 f"must be an integer in [0, {MAX_LOGPROBS}]"),
    "stop": (lambda x: isinstance(x, tuple | list) and all(isinstance(s, str) and s for s in x),
             "must be non-empty strings"),
    "presence_penalty": (lambda x: _number(x) and -2 <= x <= 2, "must be a number in [-2, 2]"),
    "frequency_penalty": (lambda x: _number(x) and -2 <= x <= 2, "must be a number in [-2, 2]"),
    "repetition_penalty": (lambda x: _number(x) and 0 < x <= MAX_TEMPERATURE,
                           f"must be a number in (0, {MAX_TEMPERATURE:g}] (1: off)"),
    "min_tokens": (lambda x: _int(x) and x >= 0, "must be an integer >= 0"),
    "logit_bias": (lambda x: isinstance(x, tuple | list) and all(
        isinstance(p, tuple | list) and len(p) == 2 and _int(p[0]) and p[0] >= 0 and
        _number(p[1]) and -100 <= p[1] <= 100 for p in x),
        "must map token ids to biases in [-100, 100]"),
}


def shown(x) -> str:
    """A value as an error message quotes it (a tuple as the list it came from)."""
    return repr(list(x) if isinstance(x, tuple) else x)


def problem(name: str, value, as_name: str | None = None) -> str | None:
    """'temperature=-1 must be a number in [0, 100] ...' for a value out of `RULES`'
    bounds (named `as_name`, as its caller calls it), None for a good one."""
    good, must = RULES[name]
    return None if good(value) else f"{as_name or name}={shown(value)} {must}"


class SamplingError(UserError):
    """Sampling values out of bounds; `problems`: (field, value, what it must be)."""

    def __init__(self, problems: list[tuple[str, object, str]]) -> None:
        super().__init__("; ".join(f"{n}={shown(v)} {must}" for n, v, must in problems))
        self.problems = problems


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens new tokens at most (None: up to the end of the context, which
    `Engine.submit` resolves to a number); greedy at temperature 0 (or below `GREEDY_BELOW`,
    where sampling is greedy in the limit and float32 overflows), else sampled with
    top-k (0: off), top-p (1: off) and a seed (a 64-bit integer; None: a fresh one);
    generation ends at the first `stop` string (not included in the text) or
    end-of-sequence token unless `ignore_eos`. `logprobs`: None, or k: each chosen
    token's log-probability under the model (before temperature) and the k likeliest
    tokens' (0 <= k <= 20); with `echo`, the prompt's tokens' too. The penalties,
    `logit_bias` and `min_tokens` shape the logits first (`tpkit.serve.logits`), then
    `grammar` masks them (`tpkit.serve.grammar`: structured outputs).
    Bounds: `RULES`."""

    max_tokens: int | None = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    grammar: str | None = None  # what the output must match (`serve.grammar`)
    adapter: int = 0  # the served LoRA adapter it runs with (0: the base; `serve.adapters`)

    def __post_init__(self) -> None:
        bad = [(f.name, getattr(self, f.name), RULES[f.name][1]) for f in fields(self)
               if f.name in RULES and problem(f.name, getattr(self, f.name))]
        if not bad and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad = [("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")]
        if bad:
            raise SamplingError(bad)


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
