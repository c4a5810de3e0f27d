"""Shared fixtures: one pool of gloo worker processes per world size, for the session.

Starting a process costs seconds (importing torch); a pool runs many checks.
`run_tp(fn, tp, *args)` runs `fn(mesh, *args)` on `tp` ranks (a ParallelMesh with
tp=tp) and returns the per-rank results; tp=1 runs in this process on
`ParallelMesh.single()` — the very same code, with a group of one.
"""

from __future__ import annotations

import pytest

from tpkit.launch import WorkerPool
from tpkit.mesh import ParallelMesh


class Pools:
    """Lazily started worker pools keyed by world size."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def get(self, n: int) -> WorkerPool:
        if n not in self._pools:
            self._pools[n] = WorkerPool(n, timeout=120, threads=1, pg_timeout_s=60)
        return self._pools[n]

    def run(self, fn, world: int, *args, mesh: dict | None = None):
        if world == 1 and mesh is not None:
            return [fn(ParallelMesh.single(), *args)]
        return self.get(world).run(fn, *args, mesh=mesh)

    def close(self) -> None:
        for p in self._pools.values():
            p.close()


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def run_tp(pools):
    """run_tp(fn, tp, *args, pp=1, dp=1) -> per-rank results of fn(mesh, *args)."""

    def run(fn, tp, *args, pp: int = 1, dp: int = 1):
        return pools.run(fn, tp * pp * dp, *args, mesh=dict(tp=tp, pp=pp, dp=dp))

    return run


@pytest.fixture(autouse=True)
def _in_own_folder(tmp_path_factory, monkeypatch):
    """Every test runs in a fresh empty working folder: a default `--out runs/train`, a run
    lock or a log lands there, never in the repository (or a user's earlier run there)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
