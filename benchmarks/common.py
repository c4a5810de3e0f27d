"""Shared helpers of the benchmarks: interleaved timing, medians, a table, JSON out.

    contenders = [Contender("tpkit tp=2", step), Contender("tp=1", step, active=rank == 0)]
    times = round_robin(contenders, reps, sync=dist.barrier)   # name -> [seconds]

Every contender runs once per round, in an order that rotates from round to round,
so that drift of the machine (frequency, caches, neighbours) hits all of them
alike. Ratios are taken between medians measured in the same run. Nothing here
asserts a time: benchmarks report, tests check.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench-results"


@dataclass
class Contender:
    """One way of doing the work: `step()` is timed, `before()` (untimed) resets state.

    A rank with `active=False` sits the contender out (it only joins the barriers),
    e.g. rank 1 while rank 0 runs the single-process reference.
    """

    name: str
    step: Callable[[], None]
    before: Callable[[], None] | None = None
    active: bool = True


def time_once(c: Contender, sync: Callable[[], None]) -> float:
    """Reset, line up with the other ranks, and time one `step()` on this rank."""
    if c.before is not None:
        c.before()
    sync()
    if not c.active:
        return 0.0
    t0 = time.perf_counter()
    c.step()
    return time.perf_counter() - t0


def round_robin(contenders: list[Contender], reps: int, sync: Callable[[], None] = lambda: None,
                warmup: int = 1) -> dict[str, list[float]]:
    """`reps` rounds, each running every contender once (rotating start); seconds per run.

    The garbage collector is off while timing (collected between rounds), for all alike.
    """
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    n = len(contenders)
    for _ in range(warmup):
        for c in contenders:
            time_once(c, sync)
    gc.collect()
    gc.disable()
    try:
        for r in range(reps):
            for i in range(n):
                c = contenders[(r + i) % n]
                times[c.name].append(time_once(c, sync))
            if r % 16 == 15:
                gc.collect()
    finally:
        gc.enable()
    return times


def reps_for(round_s: float, budget_s: float, lo: int = 5, hi: int = 400) -> int:
    """How many rounds of `round_s` seconds fit in `budget_s`, clamped to [lo, hi]."""
    return max(lo, min(hi, int(budget_s / max(round_s, 1e-9))))


def median_ms(xs: list[float]) -> float:
    """Median of seconds, in milliseconds."""
    return 1000.0 * statistics.median(xs)


def spread_ms(xs: list[float]) -> tuple[float, float]:
    """25th and 75th percentiles in milliseconds (the interquartile range)."""
    if len(xs) < 2:
        return (1000.0 * xs[0],) * 2 if xs else (0.0, 0.0)
    q = statistics.quantiles(xs, n=4)
    return 1000.0 * q[0], 1000.0 * q[2]


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores, /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def _cpu_s(pid: int) -> float:
    """CPU seconds used by process `pid`, all its threads (utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuWatch:
    """How much CPU other programs took while we timed, in cores (Linux /proc).

    On a 2-core machine a tp=2 run needs both cores: anything else running skews it
    (and skews it more than the one-core tp=1 run). `share()` is (machine busy time
    - our processes' time) / wall time since `start()`; nan where /proc is missing.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.start()

    def _sample(self) -> tuple[float, float, float]:
        try:
            return time.perf_counter(), _busy_s(), sum(_cpu_s(p) for p in self.pids)
        except (OSError, ValueError, IndexError):
            return time.perf_counter(), float("nan"), 0.0

    def start(self) -> None:
        """Begin a span."""
        self._t0, self._busy0, self._ours0 = self._sample()

    def share(self) -> float:
        """Cores used by other programs since `start()` (0.0 = the machine was ours)."""
        t, busy, ours = self._sample()
        return max(0.0, (busy - self._busy0) - (ours - self._ours0)) / max(t - self._t0, 1e-9)


def clean_rounds(contenders: list[Contender], reps: int, round_s: float,
                 sync: Callable[[], None], agree: Callable[[object], object],
                 watch: CpuWatch | None, max_s: float, block_s: float = 0.5,
                 threshold: float = 0.05, min_clean: int = 5) -> tuple[dict, dict]:
    """`round_robin` in blocks of >= `block_s`, keeping only blocks during which other
    programs used under `threshold` of a core, until `reps` clean rounds or `max_s`.

    `agree(x)` returns rank 0's `x` on every rank (so all ranks run the same blocks);
    `watch` exists on rank 0 only. Whole blocks are kept or dropped, every contender
    alike. With fewer than `min_clean` clean rounds, all rounds are used and the
    result says so. Returns (seconds per contender, facts about the run).
    """
    per_block = max(1, int(block_s / max(round_s, 1e-9)))
    kept: dict[str, list[float]] = {c.name: [] for c in contenders}
    every: dict[str, list[float]] = {c.name: [] for c in contenders}
    shares, n_clean, t0 = [], 0, time.perf_counter()
    done = False
    while not done:
        if watch is not None:
            watch.start()
        block = round_robin(contenders, min(per_block, reps), sync, warmup=0)
        share = watch.share() if watch is not None else 0.0
        clean = not share >= threshold  # nan (no /proc) counts as clean
        shares.append(share)
        for name, ts in block.items():
            every[name] += ts
            if clean:
                kept[name] += ts
        n_clean += len(next(iter(block.values()))) if clean else 0
        done = agree(n_clean >= reps or time.perf_counter() - t0 > max_s)
    enough = n_clean >= min_clean
    facts = dict(clean_rounds=n_clean, all_rounds=len(next(iter(every.values()))),
                 used="clean rounds only" if enough else "all rounds (machine was busy)",
                 others_cores_median=statistics.median(shares), others_cores_max=max(shares),
                 threshold_cores=threshold, block_rounds=per_block)
    return (kept if enough else every), facts


# -- one forward + backward, its reset, and the agreement check -------------------------------
def fwd_bwd(model, x, g, keep: dict, name: str, cpu: dict | None = None) -> Callable[[], None]:
    """A step: forward + backward of `model` on x [b, s, h] with upstream gradient `g`;
    keeps (y, dx) for `check_agree`, and this thread's CPU seconds in `cpu` if given
    (work done; time spent waiting on the other rank excluded)."""
    def step() -> None:
        t0 = time.thread_time()
        y = model(x)  # [b, s, h]
        y.backward(g)
        if cpu is not None:
            cpu.setdefault(name, []).append(time.thread_time() - t0)
        keep[name] = (y.detach(), x.grad)
    return step


def zero(model, x, ledger=None, record: bool = True, comm_s: list | None = None
         ) -> Callable[[], None]:
    """The untimed reset before a step: gradients to None; the ledger (if given) switched
    on or off and cleared, the collective seconds of the run before first appended to
    `comm_s` (if given)."""
    def before() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None
        if ledger is not None:
            if comm_s is not None and ledger.records:
                comm_s.append(ledger.total()["seconds"])
            ledger.clear()
            ledger.enabled = record
    return before


def check_agree(keep: dict, y1, dx1, where: object, tol: float = 1e-4) -> None:
    """Every contender's (y, dx) in `keep` equals the tp=1 reference (y1, dx1)."""
    for name, (y, dx) in keep.items():
        dy, ddx = (y - y1).abs().max().item(), (dx - dx1).abs().max().item()
        if max(dy, ddx) > tol:
            raise AssertionError(f"{name} disagrees with tp=1 at {where}: max |dy|={dy:.2e}, "
                                 f"max |dx|={ddx:.2e} (tol {tol:.0e})")


def agree(value: object) -> object:
    """Rank 0's `value`, on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def environment() -> dict:
    """What the numbers were measured on."""
    import torch

    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(torch=torch.__version__, python=platform.python_version(),
                cpu=model, cpu_count=os.cpu_count(), machine=platform.machine())


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A plain-text table on stdout (first column left-aligned, others right)."""
    t = Table(title=title)
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    Console(width=160, force_terminal=False, color_system=None).print(t)


def write_json(name: str, payload: dict) -> Path:
    """Write `bench-results/<name>.json` (the folder is git-ignored); return its path."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes and rounds (a smoke run, not for quoting)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timing per shape (default: set by the script)")
    return p
