"""Run a function on N local processes (gloo), for tests, demos and `--processes`.

    results = spawn(fn, 4, x, mesh=dict(tp=2, pp=2))   # fn(mesh, x) on ranks 0..3
    results = spawn_ranks(fn, 2, x)                    # fn(mesh, x), tp=2 (`tpkit.spawn`)

`spawn` starts the processes, runs `fn` once, and stops them. `WorkerPool` keeps
them alive so that many runs share one start (importing torch costs seconds): the
test suite holds one pool per world size. If any rank raises or dies, the parent
raises one `SpawnError` naming the rank and the cause within the timeout, and the
processes are killed — never a hang. The error shown is the failing rank's own: a
rank that only stopped because another failed (`peer_failed`, a collective with a
dead peer) gives way to the rank that failed first, and a rank that stopped making
progress without an error (SIGSTOP, a deadlock) is named as the stuck one. The
processes are `launch.processes`' (they die with their launcher, a signal that
interrupts the launcher kills them on the way out).
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from tpkit.comm.failure import DEFAULT_COLLECTIVE_TIMEOUT_S, says_link_failed
from tpkit.host.memory import available, gib, oom_kills, peak_rss
from tpkit.launch.processes import ended, start_workers, stop_workers, with_transport
from tpkit.spec.grid import check_sizes, world_of

_ERROR_GRACE_S = 2.0  # after a rank fails, how long the others get to report theirs
_STUCK_GRACE_MAX_S = 30.0  # ... after a collective timed out: up to one timeout, capped
_RSS_EVERY_S = 1.0  # how often the launcher reads its workers' peak RSS


class SpawnError(RuntimeError):
    """A rank raised, died, or did not finish in time.

    `original` is what the rank raised (None when it died or hung); `run_failed` is
    True when no rank raised anything of its own (a death, a hang, a timeout).
    """

    def __init__(self, message: str, rank: int | None = None,
                 original: BaseException | None = None, run_failed: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.original = original
        self.run_failed = run_failed


class WorkerPool:
    """N gloo processes kept alive between runs; `run` executes one function on all."""

    def __init__(self, nprocs: int, *, timeout: float = 120.0, threads: int | None = None,
                 pg_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, env: dict[str, str] | None = None) -> None:
        if nprocs < 1:
            raise ValueError(f"nprocs={nprocs} must be at least 1")
        self.nprocs, self.timeout = nprocs, timeout
        self.threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
        self.pg_timeout_s, self.env = pg_timeout_s, dict(env or {})
        self._procs: list = []
        self._task_id = 0

    def _start(self) -> None:
        self._store = dist.TCPStore("127.0.0.1", 0, self.nprocs + 1, is_master=True,
                                    wait_for_workers=False)
        self.run_id = os.environ.get("TPKIT_RUN_ID", "") + uuid.uuid4().hex[:8]
        env = {**self.env, "TPKIT_RUN_ID": self.run_id}
        self._procs, self._tasks, self._results, self._lifeline = start_workers(
            range(self.nprocs), self.nprocs, self._store.port, self.threads,
            self.pg_timeout_s, env)
        self._oom0, self._rss, self._rss_at = oom_kills(), [0] * self.nprocs, 0.0

    def run(self, fn: Callable, *args: Any, mesh: dict | None = None,
            timeout: float | None = None) -> list:
        """Run `fn(mesh_or_rank, *args)` on every rank; return the results in rank order.

        `mesh=dict(tp=.., pp=.., dp=..)` builds (and caches) a ParallelMesh on each
        rank and passes it; otherwise `fn` gets the rank. Raises `SpawnError` if a
        rank raises, dies, or does not finish within `timeout` seconds.
        """
        if not self._procs:
            self._start()
        if mesh is not None:
            mesh = with_transport(mesh)
        self._task_id += 1
        blob = pickle.dumps((fn, args, mesh))
        for q in self._tasks:
            q.put((self._task_id, blob))
        try:
            return self._collect(self._task_id, timeout or self.timeout)
        except BaseException:  # a failed rank, or this process interrupted by a signal
            self.close(kill=True)
            raise

    def _collect(self, task_id: int, timeout: float) -> list:
        deadline, settle = time.monotonic() + timeout, None
        out: dict[int, Any] = {}
        errors: dict[int, tuple] = {}
        while len(out) + len(errors) < self.nprocs:
            if settle is not None and time.monotonic() > settle:
                break  # the others had their chance to report
            try:
                tid, rank, status, payload = self._results.get(timeout=0.1)
            except queue.Empty:
                if settle is None and self._lost(out, deadline):
                    settle = time.monotonic() + _ERROR_GRACE_S
                continue
            if tid != task_id:
                continue
            if status == "ok":
                out[rank] = pickle.loads(payload)
                continue
            errors[rank] = payload
            if _timed_out(payload) and len(out) + len(errors) == self.nprocs - 1:
                break  # a peer is stuck and one rank is silent: that one, no more waiting
            settle = settle or time.monotonic() + self._grace(payload)
        if errors or len(out) < self.nprocs:
            raise self._root_cause(errors, out)
        return [out[r] for r in range(self.nprocs)]

    def _grace(self, error: tuple) -> float:
        """How long the other ranks get to report after the first `error`. A collective
        that timed out means a stuck peer: every rank blocked on it gives up within one
        collective timeout of starting to wait, perhaps seconds after this one, and a rank
        still silent when the grace ends is named as the stuck one (at once when only one
        rank is left silent: `_collect`)."""
        if _timed_out(error):
            return max(_ERROR_GRACE_S, min(self.pg_timeout_s, _STUCK_GRACE_MAX_S))
        return _ERROR_GRACE_S

    def _lost(self, done: dict, deadline: float) -> bool:
        """True once a rank died, or the run is past its deadline (raises then)."""
        self._sample_rss()
        if any(r not in done for r, _ in self._dead_ranks()):
            return True
        if time.monotonic() > deadline:
            late = [r for r in range(self.nprocs) if r not in done]
            raise SpawnError(f"ranks {late} did not finish within the timeout "
                             f"(others may be waiting on them in a collective)", late[0],
                             run_failed=True)
        return False

    def _root_cause(self, errors: dict[int, tuple], done: dict) -> SpawnError:
        """The error to show: a rank's own error first; else a dead rank, then a stuck
        one (alive, silent), each with what the others were waiting in."""
        own = [r for r in sorted(errors) if not errors[r][4]]
        dead = [(r, how) for r, how in self._dead_ranks() if r not in done]
        if own and not (dead and says_link_failed(errors[own[0]][1])):
            name, msg, tb, blob, _ = errors[own[0]]
            return SpawnError(f"rank {own[0]} raised {name}: {msg}\n--- traceback on rank "
                              f"{own[0]} ---\n{tb}", own[0], _unpickle(blob))
        then = f"; then {errors[min(errors)][1].splitlines()[0][:300]}" if errors else ""
        if dead:
            r, how = dead[0]
            return SpawnError(f"rank {r} died ({how}) before returning a result{then}", r,
                              run_failed=True)
        silent = [r for r in range(self.nprocs) if r not in errors and r not in done]
        if silent:  # the one the timed-out ranks suspect most (a rank waiting on a waiting
            votes = _suspect_votes(errors.values())  # rank times out later, may be silent)
            r = max(silent, key=lambda s: (votes[s], -s))
            return SpawnError(f"rank {r} stopped making progress (alive, no error "
                              f"after the others failed){then}", r, run_failed=True)
        r = min(errors)
        return SpawnError(errors[r][1].splitlines()[0], r, _unpickle(errors[r][3]),
                          run_failed=True)

    def _dead_ranks(self) -> list[tuple[int, str]]:
        out = []
        for r, p in enumerate(self._procs):
            if (how := ended(p)) is not None:
                out.append((r, how + self._oom_hint(r) if p.exitcode == -9 else how))
        return out

    def _sample_rss(self) -> None:
        """Remember each live worker's peak RSS (read once a second): a rank the kernel
        kills for memory takes its own figures with it."""
        if time.monotonic() - self._rss_at < _RSS_EVERY_S:
            return
        self._rss_at = time.monotonic()
        for r, p in enumerate(self._procs):
            self._rss[r] = max(self._rss[r], peak_rss(p.pid) or 0)

    def _oom_hint(self, rank: int) -> str:
        """': killed by the kernel, probably out of memory (...)' when the cgroup counted an
        OOM kill, or the ranks' RSS had come near what the machine offers."""
        room = available()
        near = room is not None and sum(self._rss) > 0.8 * (sum(self._rss) + room[0])
        if oom_kills() <= self._oom0 and not near:
            return ""
        where = f"; {gib(room[0])} available now, {room[1]}" if room else ""
        return (f": killed by the kernel, probably out of memory (peak RSS {gib(self._rss[rank])}"
                f" on this rank, {gib(sum(self._rss))} on all ranks{where})")

    def close(self, kill: bool = False) -> None:
        """Stop the processes (politely, or at once with kill=True): `stop_workers`."""
        if not self._procs:
            return
        procs, self._procs = self._procs, []
        stop_workers(procs, self._tasks, self._lifeline, self.run_id, kill)
        self._store = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(kill=kind is not None)

    def __del__(self) -> None:
        try:
            self.close(kill=True)
        except Exception:  # noqa: BLE001
            pass


def _suspect_votes(errors) -> Counter:
    """rank -> how many reported errors name it as a suspect (`CollectiveFailed`)."""
    return Counter(r for e in errors for r in getattr(_unpickle(e[3]), "suspects", None) or [])


def _timed_out(error: tuple) -> bool:
    """Is a rank's reported error a collective that timed out (a stuck peer)?"""
    return getattr(_unpickle(error[3]), "timed_out", False) is True


def _unpickle(blob: bytes | None) -> BaseException | None:
    if blob is None:
        return None
    try:
        return pickle.loads(blob)
    except Exception:  # noqa: BLE001
        return None


def spawn(fn: Callable, nprocs: int, *args: Any, timeout: float = 120.0,
          mesh: dict | None = None, threads: int | None = None,
          env: dict[str, str] | None = None,
          collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> list:
    """Run `fn(mesh_or_rank, *args)` on `nprocs` fresh local gloo processes.

    Returns the per-rank results (rank order). A rank that raises or dies gives one
    `SpawnError` naming it, within `timeout` seconds; a collective (default group and
    every group of the mesh) waiting longer than `collective_timeout` fails.
    """
    with WorkerPool(nprocs, timeout=timeout, threads=threads, env=env,
                    pg_timeout_s=collective_timeout) as pool:
        return pool.run(fn, *args, mesh=mesh)


def spawn_ranks(fn: Callable, n: int, *args: Any, tp: int | None = None, pp: int = 1,
                dp: int = 1, cp: int = 1, **kw: Any) -> list:
    """`fn(mesh, *args)` on `n` fresh local processes, `mesh` being this rank's
    `ParallelMesh` of (tp, pp, dp, cp) (tp: what the others leave, all of `n` by
    default); returns the per-rank results. This is `tpkit.spawn`; `kw` as `spawn`
    takes them."""
    tp = tp or n // world_of(1, pp, dp, cp)
    check_sizes(n, tp, pp, dp, cp)  # a UserError naming the numbers, before any process
    return spawn(fn, n, *args, mesh=dict(tp=tp, pp=pp, dp=dp, cp=cp), **kw)
