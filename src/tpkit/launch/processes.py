"""The worker processes every launch starts, and the one way they are stopped.

    procs, tasks, results, lifeline = start_workers(range(1, 4), 4, port, ...)
    stop_workers(procs, tasks, lifeline, run_id)        # politely, or kill=True
    signal_workers(signal.SIGINT)                       # a launcher passing a stop on

Each worker (`worker_main`) joins the gloo group of the launch, then runs the tasks it is
handed and puts each result (or error) on the shared results queue. No worker outlives
its launcher: each watches a pipe that only the launcher holds open and kills itself
when the launcher is gone (even by SIGKILL). A SIGINT (a terminal's Ctrl-C reaches
every process of its group) is only recorded (`tpkit.host.stop`): the launcher decides. Each start is one run (TPKIT_RUN_ID, in the
names of its shared-memory segments): whoever stops the workers also removes any segment
of theirs still named in /dev/shm.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tpkit.comm.shm_names import remove_segments
from tpkit.comm.transport import shm_ready
from tpkit.host import stop
from tpkit.host.forkserver import context as mp_context
from tpkit.host.memory import make_preferred_oom_victim
from tpkit.mesh import ParallelMesh
from tpkit.spec.transport import comm_choice


def watch_launcher(lifeline, run_id: str | None = None) -> None:
    """Kill this worker as soon as its launcher is gone (even by SIGKILL): a thread waits
    on `lifeline`, the read end of a pipe whose write end only the launcher holds; the
    kernel closes that end when the launcher dies, and the wait ends. (The forkserver,
    the workers' parent, lives as long as they do, so a parent-death signal would not
    fire.) The run's shared-memory segments still named go first (`run_id`)."""
    def wait() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        remove_segments(run_id)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="tpkit-launcher-watch", daemon=True).start()


def worker_main(rank: int, nprocs: int, port: int, tasks, results, threads: int,
                pg_timeout_s: float, env: dict[str, str], lifeline) -> None:
    """A worker process: join the group of `nprocs` at `port`, then run each task from
    `tasks` and put its result (or its error) on `results`; dies with the launcher."""
    stop.launcher_decides()  # a Ctrl-C here too: recorded, quietly; the launcher decides
    watch_launcher(lifeline, env.get("TPKIT_RUN_ID"))
    make_preferred_oom_victim()  # out of memory, the kernel kills a worker, not the launcher
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
            rank_or_mesh = rank  # what fn is handed first: the rank, or its mesh
            if mesh_kw is not None:
                key = tuple(sorted(mesh_kw.items()))
                if key not in meshes:
                    meshes[key] = ParallelMesh(**{"timeout_s": pg_timeout_s, **mesh_kw})
                rank_or_mesh = meshes[key]
                rank_or_mesh.ledger.clear()
                rank_or_mesh.ledger.enabled = True
            out = fn(rank_or_mesh, *args)
            results.put((task_id, rank, "ok", pickle.dumps(out)))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            try:
                blob = pickle.dumps(e)
            except Exception:  # noqa: BLE001
                blob = None
            results.put((task_id, rank, "err", (type(e).__name__, str(e),
                                                traceback.format_exc(), blob,
                                                _secondary(e))))
        stop.forget()  # a stop asked during this task was this task's (the next starts afresh)
    if nprocs > 1:
        dist.destroy_process_group()


def start_workers(ranks: range, world: int, port: int, threads: int, pg_timeout_s: float,
                  env: dict[str, str], name: str | None = None) -> tuple[list, list, Any, Any]:
    """One `worker_main` process per rank in `ranks` of a group of `world` that meets at
    the TCPStore on `port`. Returns (processes, their task queues, the results queue,
    the lifeline's write end: the workers exit when it closes, or when we die)."""
    ctx = mp_context()
    results = ctx.Queue()
    tasks = [ctx.Queue() for _ in ranks]
    lifeline, keep = ctx.Pipe(duplex=False)  # workers read, only we hold the write end
    procs = [ctx.Process(target=worker_main, daemon=True,
                         name=None if name is None else f"{name}{r}",
                         args=(r, world, port, q, results, threads, pg_timeout_s, env,
                               lifeline))
             for r, q in zip(ranks, tasks)]
    for p in procs:
        p.start()
    _LIVE.update((p.pid, p) for p in procs)
    lifeline.close()
    return procs, tasks, results, keep


_LIVE: dict = {}  # pid -> every worker this process started and has not stopped


def signal_workers(signum: int) -> bool:
    """Send `signum` to every worker this process started that still runs (a launcher
    passing on the first SIGINT/SIGTERM: `tpkit.host.stop.passed_on`); False if none."""
    sent = False
    for p in list(_LIVE.values()):
        if p.is_alive():
            try:
                os.kill(p.pid, signum)
                sent = True
            except ProcessLookupError:  # ended meanwhile
                pass
    return sent


def stop_workers(procs: list, tasks: list, lifeline, run_id: str, kill: bool = False,
                 wait_s: float = 5.0) -> None:
    """Stop workers `start_workers` started: tell each to end after its task (None on its
    queue) and wait up to `wait_s`, or at once with kill=True; kill any left, close the
    lifeline, remove the run's shared-memory segments still named. The one close of
    every pool (`WorkerPool.close`, `Followers.close`)."""
    if not kill:
        for q in tasks:
            q.put(None)
        for p in procs:
            p.join(timeout=wait_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
        _LIVE.pop(p.pid, None)
    lifeline.close()
    remove_segments(run_id)


def ended(p) -> str | None:
    """How worker process `p` ended ('signal 9', 'exit code 1'), or None while it runs."""
    if p.exitcode is None:
        return None
    return f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"


def with_transport(mesh: dict) -> dict:
    """The mesh's transport, decided here once for all ranks: an error before any rank
    runs (--comm shm without kernels), or gloo with one warning line from the launcher."""
    comm = comm_choice(mesh.get("comm"))
    if comm != "gloo" and not shm_ready(comm, 0):
        comm = "gloo"
    return {**mesh, "comm": comm}


def _secondary(e: BaseException) -> bool:
    """True when this rank failed only because another did (a collective with a dead or
    stuck peer, "another rank failed to ..."): the other rank's error is the one to show."""
    return bool(getattr(e, "run_failed", False) or getattr(e, "peer_failed", False))
