"""Measuring this machine for the planner (`tpkit calibrate` fits and writes what these
return; the fits are pure Python in `tpkit.plan.fit`).

    matmul      float32, the 3 GEMMs of a linear layer of smallest side d = 16..1024, on
                one thread or all of them
    elementwise a layer's mix at activation size (layer norm, tanh-GELU on the 4h MLP
                activation, residual add): the bytes/s elementwise kernels get
    dispatch    a chain of tiny multiplies, forward + backward: seconds per dispatched op
    all-reduce  groups of p local processes, 8 bytes and 4 KiB .. 16 MiB, over the
                transport a run uses inside a host (shared memory) and over gloo; 2 x cores
                processes in pairs: the latency of a step when processes outnumber cores

A "device" here is one process with one thread (how `tpkit.launch` runs tests with
`threads=1`).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tpkit.comm import all_reduce
from tpkit.launch import spawn

# 8 bytes (the loss, the gradient norm: `plan.fit` keeps it out of the ring's fit), then
# 4 KiB, 16 KiB, ... 16 MiB: x4 apart
SIZES = (8, *(4 << (10 + 2 * i) for i in range(7)))
DIMS = (16, 32, 64, 128, 256, 512, 1024)


def _best_time(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_matmul(threads: int, dims: tuple[int, ...] = DIMS, m: int = 1024) -> list:
    """[(d, FLOP/s)] of the three GEMMs of a linear layer whose smallest side is d.

    x [m, d] @ w [d, m] (forward), g [m, m] @ w^T (input gradient), x^T @ g (weight
    gradient): float32, on `threads` threads, the FLOPs of all three over their time.
    """

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = []
        for d in dims:
            x, w, g = torch.randn(m, d), torch.randn(d, m), torch.randn(m, m)
            seconds = _best_time(lambda x=x, w=w, g=g: (x @ w, g @ w.t(), x.t() @ g))
            out.append((d, 3 * 2 * m * d * m / seconds))
        return out
    finally:
        torch.set_num_threads(old)


def measure_memory_bandwidth(tokens: int = 512, h: int = 256) -> float:
    """Bytes/s (reads + writes) of a layer's elementwise kernels, on one thread.

    layer_norm(x) 2nh, tanh-GELU(u) 2 n 4h, x + y 3nh: 13 nh floats for x [n, h], u [n, 4h].
    On a CPU the GELU's tanh, not the memory, sets most of the time.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, u = torch.randn(tokens, h), torch.randn(tokens, 4 * h)

        def layer_mix():
            F.layer_norm(x, (h,))
            F.gelu(u, approximate="tanh")
            return x + x

        return 13 * tokens * h * 4 / _best_time(layer_mix, reps=20)
    finally:
        torch.set_num_threads(old)


def measure_op_overhead(links: int = 200) -> float:
    """Seconds per dispatched op: `links` tiny multiplies, forward + backward, one thread."""
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, requires_grad=True)

    def chain():
        y = x
        for _ in range(links):
            y = y * 1.0001
        y.sum().backward()

    with Count():
        chain()
    return _best_time(chain, reps=20) / Count.n


def _all_reduce_worker(mesh, sizes: tuple[int, ...], reps: int,
                       group: str = "tp") -> tuple[str, list]:
    """Each all-reduce follows the same ~0.3 ms matmul on every rank, as in training: the
    ranks arrive from compute (not from a barrier, where gloo is still polling), so the
    time includes waking the waiting peer. The mean, not the median: a step pays the sum
    of its collectives, the occasional descheduled peer included."""

    mesh.ledger.enabled = False
    a = torch.randn(192, 192)
    out = []
    for n in sizes:
        x = torch.ones(max(n // 4, 1))
        times = []
        for i in range(reps * (4 if n < 1024 else 1) + 2):  # a few bytes: cheap, noisy
            a @ a @ a @ a  # [192, 192]: ~0.3 ms of work between collectives
            t0 = time.perf_counter()
            all_reduce(x, mesh.groups[group])
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out.append((n, statistics.mean(times)))
    return mesh.groups[group].transport, out


def measure_all_reduce(nprocs: int, sizes: tuple[int, ...] = SIZES, reps: int = 10,
                       groups: int = 1, comm: str | None = None) -> tuple[str, list]:
    """(transport, [(p, bytes, seconds)]) of all-reduces in groups of `nprocs` local
    processes, `groups` groups at once (rank 0's view), over `comm` as a run chooses it
    (None: TPKIT_COMM or auto, i.e. shared memory as `tpkit train` uses between the ranks
    of a host; "gloo": the process group, what groups across hosts use)."""
    transport, results = spawn(_all_reduce_worker, nprocs * groups, sizes, reps,
                               mesh=dict(tp=nprocs, dp=groups, comm=comm), threads=1)[0]
    return transport, [(nprocs, n, t) for n, t in results]


def measure_shared_latency(cores: int, reps: int) -> float:
    """Seconds per ring step of a 4 KiB all-reduce in pairs, with 2 x cores processes.

    0.0 (not measured) above 4 cores: such a host plans one process per core."""
    if cores > 4:
        return 0.0
    _, ((_, _, t),) = measure_all_reduce(2, (4 << 10,), reps, groups=cores)
    return t / 2


def measure_across(sizes: tuple[int, ...] = SIZES, reps: int = 10) -> dict:
    """Under torchrun with P processes per host: all-reduces between the hosts, as
    `tpkit train`'s groups across hosts run them (the same mesh, transport and
    interface), in groups of one rank per host, the P groups at once (the port and the
    cores shared as a run with P per host shares them); with P > 1, then inside each
    host (its P ranks, every host at once, on the transport a run uses there).

    Returns (on every rank) {"transport", "samples": [(p, bytes, seconds)] (rank 0's
    view), "inside": (transport, samples) or None with P = 1, "per_host": P, "hosts":
    each rank's hostname, "machines": how many distinct kernels (boot ids) run them:
    simulated hosts (`tpkit cluster`) are one machine and share its cores}.
    """
    import torch.distributed as dist

    from tpkit.mesh import ParallelMesh

    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mesh = ParallelMesh.from_env(tp=per_host, dp=None)
    transport, got = _all_reduce_worker(mesh, sizes, reps, group="dp")
    inside = _all_reduce_worker(mesh, sizes, reps, group="tp") if per_host > 1 else None
    me = (socket.gethostname(), Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    everyone: list = [None] * mesh.world_size
    dist.all_gather_object(everyone, me)
    found: list = [(got, inside)]
    dist.broadcast_object_list(found, src=0)
    dist.destroy_process_group()
    got, inside = found[0]
    return {"transport": transport, "samples": [(mesh.dp_size, n, t) for n, t in got],
            "inside": inside and (inside[0], [(per_host, n, t) for n, t in inside[1]]),
            "per_host": per_host, "hosts": [h for h, _ in everyone[::per_host]],
            "machines": len({b for _, b in everyone})}
