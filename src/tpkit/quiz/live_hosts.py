"""Answers 3 and 8 measured across simulated hosts (`tpkit cluster`), where they can be made.

    found = across_hosts(JOBS)   # {"10gbit": {numel: per-rank results}, ...} or why not

For each link speed a cluster of two hosts is made (network namespaces joined by a
shaped link), one rank started inside each (`python -m tpkit.quiz.live_hosts RANK ...`,
torchrun's environment), the same `live_ranks.all_reduce_times` run between them as the
one-host demonstration runs between local processes (tp=2: the group spans the two
hosts, so it goes over gloo on the link), and the cluster removed. Without root (or ip,
tc, unshare) it returns the one line saying what is missing, and the demonstrations
explain instead of measuring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tpkit.cluster import hosts
from tpkit.cluster.checks import missing
from tpkit.cluster.layout import Layout

LINKS = ("10gbit", "1gbit")
PORT = "29512"
Jobs = dict[int, tuple[int, ...]]  # floats per all-reduce -> sequence lengths to time
JOBS: Jobs = {32768: (4,), 256: (1, 2, 4, 8)}  # answer 3's [1, 128, 256]; answer 8's


def across_hosts(jobs: Jobs, links: tuple[str, ...] = LINKS, timeout: float = 300.0
                 ) -> dict[str, dict[int, list[dict]]] | str:
    """Per link: per job's numel, the two ranks' `all_reduce_times` results; or why
    hosts cannot be made here (one line)."""
    why = missing()
    if why:
        return why
    found = {}
    for link in links:
        layout = Layout(f"tq{os.getpid() % 100000}", 2, link)
        hosts.up(layout)
        try:
            found[link] = _measure(layout, jobs, timeout)
        finally:
            hosts.down(layout)
    return found


def _measure(layout: Layout, jobs: Jobs, timeout: float) -> dict[int, list[dict]]:
    env = dict(os.environ, MASTER_ADDR=layout.host(0), MASTER_PORT=PORT, WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1", TPKIT_COMM="auto")
    env.pop("GLOO_SOCKET_IFNAME", None)
    spec = json.dumps({str(n): list(k) for n, k in jobs.items()})
    procs = [subprocess.Popen(hosts.enter_argv(layout, r, [sys.executable, "-m", __name__, spec]),
                              env=dict(env, RANK=str(r), LOCAL_RANK="0"), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    try:
        said = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, said):
        if p.returncode != 0:
            raise RuntimeError(f"a rank across hosts failed: {err.strip().splitlines()[-1:]}")
    found = json.loads(said[0][0].strip().splitlines()[-1])
    return {int(n): [{**r, "times": {int(k): t for k, t in r["times"].items()}} for r in ranks]
            for n, ranks in found.items()}


def _rank(spec: str) -> None:
    """One rank inside a host: every job's timings, gathered and printed by rank 0."""
    import torch.distributed as dist  # lazy: the quiz imports this module without torch

    from tpkit.mesh import ParallelMesh
    from tpkit.quiz.live_ranks import all_reduce_times

    mesh = ParallelMesh.from_env(tp=2, timeout_s=120)
    mine = {n: all_reduce_times(mesh, int(n), tuple(k)) for n, k in json.loads(spec).items()}
    every: list = [None, None]
    dist.all_gather_object(every, mine)
    if mesh.rank == 0:
        print(json.dumps({n: [r[n] for r in every] for n in mine}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank(sys.argv[1])
