"""Starting ranks: where they come from, decided once (`launch`, `policy.py`), the
local processes that run them (`processes.py`) and the pools that hold them
(`pool.py`: `spawn`, `WorkerPool`, `tpkit.spawn`).

    out = launch(fn, cfg, ranks=4, mesh=dict(tp=2, pp=2))   # rank 0's fn(mesh, cfg)
    results = spawn(fn, 4, x, mesh=dict(tp=2, pp=2))       # fn(mesh, x) on 4 processes
"""

from tpkit.host.forkserver import context as mp_context
from tpkit.host.forkserver import preload
from tpkit.launch.policy import (
    Followers,
    decided_by_rank0,
    is_rank0,
    launch,
    mesh_here,
    under_torchrun,
    world_here,
)
from tpkit.launch.pool import SpawnError, WorkerPool, spawn, spawn_ranks
from tpkit.launch.processes import signal_workers, start_workers, stop_workers, with_transport

__all__ = ["Followers", "SpawnError", "WorkerPool", "decided_by_rank0", "is_rank0", "launch",
           "mesh_here", "mp_context", "preload", "signal_workers", "spawn", "spawn_ranks", "start_workers", "stop_workers",
           "under_torchrun", "with_transport", "world_here"]
