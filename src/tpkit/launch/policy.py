"""Where the ranks of a command come from, decided once (`launch`): every command that
runs ranks (train, verify, generate, serve) asks here, and `tpkit.load` takes its mesh
from the same answer (`mesh_here`). `tpkit.spawn` is the spawned row itself: it
promises n fresh local processes wherever it is called.

    out = launch(fn, cfg, ranks=4, mesh=dict(tp=2, pp=2))   # rank 0's fn(mesh, cfg)

| where this process is                       | what runs                                  |
|---------------------------------------------|--------------------------------------------|
| under torchrun (`under_torchrun`)           | this rank, on the mesh of torchrun's world |
| alone, one rank                             | fn here, on a one-process mesh             |
| alone, n ranks                              | n spawned local processes (`spawn`)        |
| alone, n ranks, `lead_here=True` (serve)    | rank 0 here (it keeps the HTTP front), ranks 1.. spawned (`Followers`) |

With `follow=(g, args)` every rank but its tp group's first runs `g(mesh, *args)`
instead (a model's followers: `tpkit.serve.workers.follow`). The answer is rank 0's
result; None in any other process.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tpkit.comm.failure import DEFAULT_COLLECTIVE_TIMEOUT_S
from tpkit.host.forkserver import stop_early, under_torchrun_env
from tpkit.launch.pool import WorkerPool, spawn
from tpkit.launch.processes import ended, start_workers, with_transport
from tpkit.mesh import ParallelMesh
from tpkit.spec.errors import UserError

Follow = tuple[Callable, tuple]  # what the followers run: fn(mesh, *args)
Setup = Callable[[ParallelMesh | None], AbstractContextManager[tuple]]


def _place() -> tuple[int, int] | None:
    """(rank, world size) of this process in a world started outside it: torchrun's (RANK
    and WORLD_SIZE in the environment, as tpkit's own workers have them too), or a default
    process group already initialized; None when it is alone."""
    place = under_torchrun_env()
    if place is not None:
        return place
    loaded = sys.modules.get("torch.distributed")  # not imported: not initialized either
    if loaded is not None and loaded.is_available() and loaded.is_initialized():
        return loaded.get_rank(), loaded.get_world_size()
    return None


def under_torchrun() -> bool:
    """Is this process one rank of a world started outside it (`_place`)? The one way
    tpkit asks."""
    return _place() is not None


def is_rank0() -> bool:
    """Is this process rank 0: alone, or rank 0 of the world it is in?"""
    place = _place()
    return place is None or place[0] == 0


def world_here() -> int | None:
    """The number of ranks of the world this process is one of (torchrun's), or None."""
    place = _place()
    return None if place is None else place[1]


def decided_by_rank0(mesh: ParallelMesh | None, fn: Callable, *args: Any) -> Any:
    """`fn(*args)` (a check, a choice) decided once: by this process when it is the
    launcher (`mesh` None), else by rank 0 and broadcast, so that every rank gets the same
    answer or raises the same UserError line and no rank goes on while another refused."""
    if mesh is None:
        return fn(*args)
    said = [None, None]
    if mesh.rank == 0:
        try:
            said[0] = fn(*args)
        except UserError as e:
            said[1] = str(e)
    dist.broadcast_object_list(said, src=0)
    if said[1] is not None:
        raise UserError(said[1])
    return said[0]


def mesh_here(tp: int | None = None) -> ParallelMesh:
    """This process's mesh when the caller gives none (`tpkit.load`): tp ranks of
    torchrun's or `tpkit.spawn`'s world, else one process (tp 1)."""
    if under_torchrun():
        return ParallelMesh.from_env(tp=tp, pp=1)
    if tp not in (None, 1):
        raise UserError(f"tp={tp} needs {tp} processes: call tpkit.load inside "
                        f"tpkit.spawn(fn, {tp}) or torchrun, or pass a mesh")
    return ParallelMesh.single()


A_WEEK_S = 7 * 24 * 3600.0  # a command's whole run: no limit in practice (a rank that dies is
# seen at once, a stuck one by the collective timeout); a long generation must not be cut


def launch(fn: Callable, *args: Any, ranks: int, mesh: dict, follow: Follow | None = None,
           setup: Setup | None = None, lead_here: bool = False, every: bool = False,
           device: torch.device | None = None, threads: int | None = None,
           timeout: float = A_WEEK_S,
           collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Any:
    """Run `fn(mesh, *args)` as rank 0 of `ranks` processes of layout `mesh` (tp, pp, dp,
    cp, comm), started as the table above says, and return its result (None in a
    process that is not rank 0). `every`: the list of the results this process sees
    instead (every rank's when it spawned them, rank 0's own under torchrun).
    `setup(mesh)`: a context manager entered once where the run is decided, around it,
    yielding more arguments for `fn`: here before any rank starts (mesh None), or on each
    of torchrun's ranks (their mesh: rank 0 decides, `decided_by_rank0`). With
    `lead_here`, `fn` is also given `followers=` (the spawned `Followers`, or None: their
    `dead()` names one that died). `device`: a one-process run's; `timeout`: a spawned
    run's, whole; `collective_timeout`: any collective's."""
    setup = setup or _nothing_to_set_up
    if under_torchrun():
        here = ParallelMesh.from_env(**mesh, timeout_s=collective_timeout)
        with setup(here) as more:
            out = _as_rank(here, fn, args + more, follow, lead_here)
            if follow is None:  # every rank ran fn: rank 0 goes on once all did (their
                dist.barrier()  # files); followers end on rank 0's STOP, nothing to wait for
                dist.destroy_process_group()
        return None if here.rank else [out] if every else out
    with setup(None) as more:
        return _here(fn, args + more, ranks, mesh, follow, lead_here, every, device,
                     dict(threads=threads, timeout=timeout,
                          collective_timeout=collective_timeout))


def _here(fn: Callable, args: tuple, ranks: int, mesh: dict, follow: Follow | None,
          lead_here: bool, every: bool, device: torch.device | None, spawn_kw: dict) -> Any:
    """`launch` in a process that is alone: one rank here, n spawned, or rank 0 here."""
    if ranks == 1:
        stop_early()  # a forkserver the CLI started for ranks there will not be
        out = _as_rank(ParallelMesh.single(device=device), fn, args, None, lead_here)
        return [out] if every else out
    if lead_here:
        followers = Followers(ranks, follow, mesh, timeout_s=spawn_kw["collective_timeout"])
        try:
            return fn(followers.mesh, *args, followers=followers)
        finally:
            followers.close()  # politely: after rank 0's STOP they return and exit
    results = spawn(_as_rank, ranks, fn, args, follow, mesh=mesh, **spawn_kw)
    return results if every else results[0]


@contextmanager
def _nothing_to_set_up(mesh: ParallelMesh | None) -> Iterator[tuple]:
    yield ()


def _as_rank(mesh: ParallelMesh, fn: Callable, args: tuple, follow: Follow | None,
             lead_here: bool = False) -> Any:
    """One rank: a follower (`follow`) unless it is its tp group's first, else `fn`."""
    if follow is not None and mesh.tp_rank != 0:
        return follow[0](mesh, *follow[1])
    return fn(mesh, *args, followers=None) if lead_here else fn(mesh, *args)


class Followers(WorkerPool):
    """Ranks 1..n-1 of a group whose rank 0 is this process, spawned to run
    `follow[0](mesh, *follow[1])` once each; `mesh` is this process's place in it.
    Stopped by the pool's one close, which also leaves the group."""

    def __init__(self, n: int, follow: Follow, mesh: dict, *,
                 timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
        super().__init__(n, pg_timeout_s=timeout_s)
        mesh_kw = with_transport(mesh)  # shared memory between us, or gloo
        self.run_id = os.environ.get("TPKIT_RUN_ID", "") + uuid.uuid4().hex[:8]
        os.environ["TPKIT_RUN_ID"] = self.run_id  # rank 0 names the segments: this run's
        torch.set_num_threads(self.threads)
        self._store = dist.TCPStore("127.0.0.1", 0, n, is_master=True,
                                    wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
        self._procs, self._tasks, self._results, self._lifeline = start_workers(
            range(1, n), n, self._store.port, self.threads, timeout_s,
            {"TPKIT_RUN_ID": self.run_id}, name="tpkit-rank")
        job = pickle.dumps((follow[0], follow[1], mesh_kw))
        for q in self._tasks:
            q.put((1, job))
        dist.init_process_group("gloo", store=self._store, rank=0, world_size=n,
                                timeout=timedelta(seconds=timeout_s))
        self.mesh = ParallelMesh(**{"timeout_s": timeout_s, **mesh_kw})

    def dead(self) -> str | None:
        """'rank 1 died (signal 9)' for a follower that is gone, or a rank's own error."""
        for r, p in enumerate(self._procs, start=1):
            if p.exitcode != 0 and (how := ended(p)) is not None:
                return f"rank {r} died ({how})"
        try:
            _, rank, status, payload = self._results.get_nowait()
        except queue.Empty:
            return None
        if status == "err":
            return f"rank {rank} raised {payload[0]}: {payload[1].splitlines()[0][:300]}"
        return None

    def unwell(self) -> str | None:
        """'rank 1 is gone' or 'rank 1 is stopped (...)' from /proc alone (it reaps nothing,
        safe from any thread: the server's /health asks while its loop runs), else None
        (also where there is no /proc)."""
        if not os.path.isdir("/proc"):
            return None
        for r, p in enumerate(self._procs, start=1):
            state = _state(p.pid)
            if state in (None, "Z", "X"):
                return f"rank {r} (pid {p.pid}) is gone"
            if state in ("T", "t"):
                return f"rank {r} (pid {p.pid}) is stopped (SIGSTOP or a debugger): stuck"
        return None

    def kill(self) -> None:
        """SIGKILL every follower now, from any thread (a collective waiting on one ends at
        once); `close` reaps them."""
        for p in self._procs:
            if p.pid is not None and _state(p.pid) not in (None, "Z", "X"):
                p.kill()

    def close(self, kill: bool = False) -> None:
        """The pool's close (the followers end after rank 0's STOP); then leave the group."""
        joined = bool(self._procs)
        super().close(kill)
        if joined and dist.is_initialized():
            dist.destroy_process_group()


def _state(pid: int) -> str | None:
    """A process's state letter in /proc (R, S, T stopped, Z zombie...), None if gone or
    not on Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
