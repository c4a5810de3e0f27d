"""What every live demonstration shares (`live_level1`, `live_level2`): the session it
runs on, seen as the one method it uses, and small measuring helpers. Its own module so
that the session (`live.LiveSession`), which runs the demonstrations, and the
demonstrations, which run on a session, import it and not each other.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Protocol

import torch


class Spawner(Protocol):
    """What a demonstration needs of its session (`live.LiveSession` is one)."""

    def spawn(self, fn: Callable, *args, tp: int, pp: int = 1, dp: int = 1) -> list:
        """Run `fn(mesh, *args)` on tp*pp*dp ranks; per-rank results in rank order."""

    def across(self) -> dict | str:
        """All-reduces timed across simulated hosts per link, or why not (one line)."""


def x_input(b: int, s: int, h: int, seed: int = 0) -> torch.Tensor:
    """A reproducible input [b, s, h]."""
    return torch.randn(b, s, h, generator=torch.Generator().manual_seed(seed))  # [b, s, h]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| as a float."""
    return float((a - b).detach().abs().max())


def median_of_slowest(per_rank: list[dict], key: str = "times") -> dict[int, float]:
    """Per count: the median over repeats of the slowest rank's time (a collective ends
    when its last rank does), from `live_ranks.all_reduce_times` (its `key`)."""
    per_rank = [r[key] for r in per_rank]
    counts = per_rank[0]
    return {n: statistics.median(max(r[n][i] for r in per_rank) for i in range(len(counts[n])))
            for n in counts}


def start_and_each(measured: dict[int, float]) -> tuple[float, float]:
    """(fixed start, cost of each) in seconds: the least-squares line t(k) = start + k x
    each through sequences of k collectives (`median_of_slowest`); each >= 0, start >= 0."""
    ks, ts = list(measured), list(measured.values())
    mk, mt = statistics.fmean(ks), statistics.fmean(ts)
    spread = sum((k - mk) ** 2 for k in ks)
    each = max(sum((k - mk) * (t - mt) for k, t in zip(ks, ts)) / spread, 0.0) if spread else \
        mt / mk
    start = max(mt - each * mk, 0.0)
    return start, each
