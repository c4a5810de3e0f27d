"""Live demonstrations: each quiz answer proved by a real run of the library on CPU processes.

    with LiveSession() as live:
        figures = live.run(2, tp=4)            # dict of computed figures, "text", "charts"
        live.run(3, tp=2, lang="fr", level=2)  # a level-2 demonstration, told in French

One function per answer (`live_level1.DEMOS`, `live_level2.DEMOS`); each spawns gloo
ranks (processes are kept in a pool per world size and reused) or asks the planner,
runs the real layers, collectives and ledger, and returns what it measured: the
figures, the text (words from `live_text.json`) and charts for the web page
(`live_charts`). Nothing is canned: change tp and the figures change. Timings are
medians over warm repeats. The per-rank functions live in `live_ranks`.
"""

from __future__ import annotations

from collections.abc import Callable

Runner = Callable[..., list]  # runner(fn, world, *args, mesh=dict(tp=, pp=, dp=)) -> per rank


class LiveSession:
    """Worker pools (one per world size) shared by all demonstrations of a sitting."""

    def __init__(self, runner: Runner | None = None, timeout: float = 120.0,
                 comm: str | None = None, hosts: bool | None = None) -> None:
        self._runner, self._pools, self.timeout = runner, {}, timeout
        self.comm = comm  # the transport of the ranks' groups (None: TPKIT_COMM, else auto)
        self.hosts = runner is None if hosts is None else hosts  # answers 3, 8 across hosts
        self._across: dict | str | None = None

    def across(self) -> dict | str:
        """Answers 3 and 8's all-reduces timed across two simulated hosts at each link
        speed (`live_hosts.across_hosts`), once per sitting; or why not, in one line."""
        if not self.hosts:
            return "this session measures on one host only"
        if self._across is None:
            from tpkit.quiz.live_hosts import JOBS, across_hosts  # lazy: root, ip, torch

            try:
                self._across = across_hosts(JOBS)
            except (RuntimeError, OSError, ValueError) as e:  # UserError is a ValueError
                self._across = f"making them failed: {e}"
        return self._across

    def spawn(self, fn: Callable, *args, tp: int, pp: int = 1, dp: int = 1) -> list:
        """Run `fn(mesh, *args)` on tp*pp*dp ranks; per-rank results in rank order."""
        mesh, world = dict(tp=tp, pp=pp, dp=dp), tp * pp * dp
        if self.comm is not None:
            mesh["comm"] = self.comm
        if self._runner is not None:
            return self._runner(fn, world, *args, mesh=mesh)
        if world not in self._pools:
            # lazy: torch; the quiz starts without it
            from tpkit.launch import WorkerPool

            self._pools[world] = WorkerPool(world, timeout=self.timeout, threads=1)
        return self._pools[world].run(fn, *args, mesh=mesh)

    def run(self, number: int, tp: int = 2, lang: str = "en", level: int = 1) -> dict:
        """Demonstration `number` (1..8) of `level` at tensor-parallel size `tp`, in `lang`."""
        # lazy: torch, as above
        from tpkit.quiz.live_level1 import DEMOS as LEVEL1
        from tpkit.quiz.live_level2 import DEMOS as LEVEL2

        demos = {1: LEVEL1, 2: LEVEL2}.get(level)
        if demos is None:
            raise ValueError(f"no level {level}; levels are 1 and 2")
        if number not in demos:
            raise ValueError(f"no demonstration {number}; they are numbered 1 to 8")
        return demos[number](self, tp=tp, lang=lang)

    def text(self, number: int, tp: int = 2, lang: str = "en", level: int = 1) -> str:
        """Only the text rendering of `run`."""
        return self.run(number, tp, lang, level)["text"]

    def close(self) -> None:
        """Stop the worker processes."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> LiveSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
