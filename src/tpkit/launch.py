"""Run a function on N local processes (gloo), for tests, demos and `--nproc`.

    results = spawn(fn, 4, x, mesh=dict(tp=2, pp=2))   # fn(mesh, x) on ranks 0..3

`spawn` starts the processes, runs `fn` once, and stops them. `WorkerPool` keeps
them alive so that many runs share one start (importing torch costs seconds): the
test suite holds one pool per world size. If any rank raises or dies, the parent
raises one `SpawnError` naming the rank and the cause within the timeout, and the
processes are killed — never a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_CTX = None


class SpawnError(RuntimeError):
    """A rank raised, died, or did not finish in time."""

    def __init__(self, message: str, rank: int | None = None,
                 original: BaseException | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.original = original


def _context():
    global _CTX  # the multiprocessing context, created once per process (not parallel state)
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "tpkit.launch"])
    return _CTX


def _worker(rank: int, nprocs: int, port: int, tasks, results, threads: int,
            pg_timeout_s: float, env: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(nprocs))
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, nprocs, is_master=False,
                          timeout=timedelta(seconds=pg_timeout_s))
    if nprocs > 1:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=nprocs,
                                timeout=timedelta(seconds=pg_timeout_s))
    meshes: dict[tuple, Any] = {}
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn_bytes = task
        try:
            fn, args, mesh_kw = pickle.loads(fn_bytes)
            first = rank
            if mesh_kw is not None:
                key = tuple(sorted(mesh_kw.items()))
                if key not in meshes:
                    from tpkit.mesh import ParallelMesh
                    meshes[key] = ParallelMesh(**mesh_kw)
                first = meshes[key]
                first.ledger.clear()
                first.ledger.enabled = True
            out = fn(first, *args)
            results.put((task_id, rank, "ok", pickle.dumps(out)))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            try:
                blob = pickle.dumps(e)
            except Exception:  # noqa: BLE001
                blob = None
            results.put((task_id, rank, "err", (type(e).__name__, str(e),
                                                traceback.format_exc(), blob)))
    if nprocs > 1:
        dist.destroy_process_group()


class WorkerPool:
    """N gloo processes kept alive between runs; `run` executes one function on all."""

    def __init__(self, nprocs: int, *, timeout: float = 120.0, threads: int | None = None,
                 pg_timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        if nprocs < 1:
            raise ValueError(f"nprocs={nprocs} must be at least 1")
        self.nprocs, self.timeout = nprocs, timeout
        self.threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
        self.pg_timeout_s, self.env = pg_timeout_s, dict(env or {})
        self._procs: list = []
        self._task_id = 0

    def _start(self) -> None:
        import torch.distributed as dist

        ctx = _context()
        self._store = dist.TCPStore("127.0.0.1", 0, self.nprocs + 1, is_master=True,
                                    wait_for_workers=False)
        port = self._store.port
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.nprocs)]
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.nprocs, port, self._tasks[r], self._results,
                                         self.threads, self.pg_timeout_s, self.env))
                       for r in range(self.nprocs)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any, mesh: dict | None = None,
            timeout: float | None = None) -> list:
        """Run `fn(mesh_or_rank, *args)` on every rank; return the results in rank order.

        `mesh=dict(tp=.., pp=.., dp=..)` builds (and caches) a ParallelMesh on each
        rank and passes it; otherwise `fn` gets the rank. Raises `SpawnError` if a
        rank raises, dies, or does not finish within `timeout` seconds.
        """
        if not self._procs:
            self._start()
        self._task_id += 1
        blob = pickle.dumps((fn, args, mesh))
        for q in self._tasks:
            q.put((self._task_id, blob))
        try:
            return self._collect(self._task_id, timeout or self.timeout)
        except SpawnError:
            self.close(kill=True)
            raise

    def _collect(self, task_id: int, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
        while len(out) < self.nprocs:
            try:
                tid, rank, status, payload = self._results.get(timeout=0.1)
            except queue.Empty:
                self._check_alive(out, deadline)
                continue
            if tid != task_id:
                continue
            if status == "err":
                raise self._root_cause(rank, payload)
            out[rank] = pickle.loads(payload)
        return [out[r] for r in range(self.nprocs)]

    def _root_cause(self, rank: int, payload: tuple, grace_s: float = 1.0) -> SpawnError:
        """A rank raised. A peer that died first makes the others fail in a collective
        ("connection reset"); wait briefly and name the dead rank as the cause if any."""
        name, msg, tb, exc_blob = payload
        first = SpawnError(f"rank {rank} raised {name}: {msg}\n--- traceback on rank "
                           f"{rank} ---\n{tb}", rank, _unpickle(exc_blob))
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            dead = self._dead_ranks()
            if dead and rank not in dead:
                r, how = dead[0]
                return SpawnError(f"rank {r} died ({how}) before returning a result; "
                                  f"rank {rank} then failed: {name}: {msg.splitlines()[0][:200]}",
                                  r)
            time.sleep(0.05)
        return first

    def _dead_ranks(self) -> list[tuple[int, str]]:
        out = []
        for r, p in enumerate(self._procs):
            if p.exitcode is not None:
                out.append((r, f"signal {-p.exitcode}" if p.exitcode < 0
                            else f"exit code {p.exitcode}"))
        return out

    def _check_alive(self, done: dict, deadline: float) -> None:
        for r, how in self._dead_ranks():
            if r not in done:
                raise SpawnError(f"rank {r} died ({how}) before returning a result", r)
        if time.monotonic() > deadline:
            late = [r for r in range(self.nprocs) if r not in done]
            raise SpawnError(f"ranks {late} did not finish within the timeout "
                             f"(others may be waiting on them in a collective)", late[0])

    def close(self, kill: bool = False) -> None:
        """Stop the processes (politely, or at once with kill=True)."""
        if not self._procs:
            return
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=5)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._store = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(kill=True)
        except Exception:  # noqa: BLE001
            pass


def _unpickle(blob: bytes | None) -> BaseException | None:
    if blob is None:
        return None
    try:
        return pickle.loads(blob)
    except Exception:  # noqa: BLE001
        return None


def spawn(fn: Callable, nprocs: int, *args: Any, timeout: float = 120.0,
          mesh: dict | None = None, threads: int | None = None,
          env: dict[str, str] | None = None) -> list:
    """Run `fn(mesh_or_rank, *args)` on `nprocs` fresh local gloo processes.

    Returns the per-rank results (rank order). A rank that raises or dies gives one
    `SpawnError` naming it, within `timeout` seconds.
    """
    with WorkerPool(nprocs, timeout=timeout, threads=threads, env=env) as pool:
        return pool.run(fn, *args, mesh=mesh)
