"""Collective latency between the ranks of one host: tpkit's shared memory against gloo,
and against DeepSpeed's CPU shared-memory all-reduce where it can be had.

    tpkit shm      tpkit.comm.all_reduce / all_gather / reduce_scatter on a group with a
                   shared-memory channel (the path every caller takes: ledger, guard)
    gloo           the same calls on the same process group without the channel
    DeepSpeed shm  deepspeed.comm.inference_all_reduce (its op built with g++ at first
                   use); skipped, with the reason printed, if it cannot be imported

float32 tensors of 4 B to 64 MiB (the all-gather's input is that size over the ranks).
Both ranks run every contender in lockstep: per size, blocks of calls (a barrier
before each block) alternate between contenders; the figure is rank 0's median time
per call over the blocks.

    .venv/bin/python benchmarks/collectives.py [--quick] [--ranks 2,4]
    PYTHONPATH=<folder with deepspeed> ... to include DeepSpeed (never a tpkit dependency)

Writes bench-results/collectives.json.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from common import environment, parser, print_table, write_json
from tpkit.comm import all_gather, all_reduce, reduce_scatter
from tpkit.launch import spawn

SIZES = [4 << (2 * i) for i in range(13)]  # 4 B, 16 B, ... 64 MiB
QUICK_SIZES = [4, 1024, 65536, 1 << 20, 16 << 20]
OPS = ("all_reduce", "all_gather", "reduce_scatter")
TARGET_US = 20.0  # per all-reduce up to 64 KiB on 2 ranks
TARGET_X_GLOO = 40.0


def _deepspeed():
    """DeepSpeed's inference all-reduce, or the reason it is not available."""
    try:
        import deepspeed.comm as ds_comm

        ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        if not hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
            return None, "its shm op did not build (it would fall back to gloo)"
        x = torch.ones(4)
        ds_comm.inference_all_reduce(x)
        if x[0].item() != dist.get_world_size():
            return None, "DeepSpeed's all-reduce gave a wrong sum"
        return ds_comm.inference_all_reduce, None
    except Exception as e:  # noqa: BLE001 - any failure is a reason printed, not a crash
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _calls(op: str, group, x: torch.Tensor, ds) -> dict:
    p = group.size
    if op == "all_reduce":
        out = {"tpkit shm": lambda: all_reduce(x, group)}
        gloo = dataclasses.replace(group, shm=None)
        out["gloo"] = lambda: all_reduce(x, gloo)
        if ds is not None:
            out["DeepSpeed shm"] = lambda: ds(x)
        return out
    gloo = dataclasses.replace(group, shm=None)
    if op == "all_gather":
        part = x[: max(x.numel() // p, 1)]
        return {"tpkit shm": lambda: all_gather(part, group, 0),
                "gloo": lambda: all_gather(part, gloo, 0)}
    whole = x[: x.numel() // p * p] if x.numel() >= p else x.repeat(p)
    return {"tpkit shm": lambda: reduce_scatter(whole, group, 0),
            "gloo": lambda: reduce_scatter(whole, gloo, 0)}


def _time(fns: dict, budget_s: float, ledger) -> dict[str, float]:
    """Median seconds per call of each contender, in alternating blocks. The ledger
    records every call (as in a run) and is emptied before each block: millions of
    records kept would make the garbage collector's passes part of the figures."""
    for f in fns.values():
        f()
    t0 = time.perf_counter()
    for f in fns.values():
        f()
    first = [time.perf_counter() - t0]
    dist.broadcast_object_list(first, src=0)
    per_call = max(first[0] / len(fns), 1e-6)
    reps = [max(1, min(2000, int(0.02 / per_call)))]  # calls per block, ~20 ms of the slowest
    dist.broadcast_object_list(reps, src=0)
    blocks = max(3, min(40, int(budget_s / max(len(fns) * reps[0] * per_call, 1e-6))))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for b in range(blocks):
        names = list(fns)[b % len(fns):] + list(fns)[:b % len(fns)]
        for name in names:
            ledger.clear()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps[0]):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / reps[0])
    return {k: statistics.median(v) for k, v in times.items()}


def _worker(mesh, sizes: list[int], budget_s: float) -> list[dict] | None:
    torch.manual_seed(0)
    ds, why = _deepspeed() if mesh.world_size == 2 else (None, "2 ranks only")
    rows = []
    for op in OPS:
        for nbytes in sizes:
            x = torch.randn(max(nbytes // 4, 1))
            fns = _calls(op, mesh.tp_group, x, ds if op == "all_reduce" else None)
            rows.append(dict(op=op, nbytes=nbytes, ranks=mesh.world_size,
                             us={k: 1e6 * v for k, v in _time(fns, budget_s, mesh.ledger).items()}))
    return [*rows, {"deepspeed": why}] if mesh.rank == 0 else None


def _human(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def report(rows: list[dict]) -> dict:
    """The table and the verdicts (2 ranks): <= 20 us and >= 40x gloo up to 64 KiB; never
    slower than DeepSpeed's at any size."""
    table = []
    for r in rows:
        us = r["us"]
        ds = us.get("DeepSpeed shm")
        table.append([r["op"], str(r["ranks"]), _human(r["nbytes"]), f"{us['tpkit shm']:.1f}",
                      f"{us['gloo']:.1f}", f"{us['gloo'] / us['tpkit shm']:.0f}x",
                      "-" if ds is None else f"{ds:.1f}"])
    print_table("latency per call (us, rank 0's median; float32)", ["op", "ranks", "size",
                "tpkit shm", "gloo", "gloo / shm", "DeepSpeed shm"], table)
    small = [r for r in rows if r["op"] == "all_reduce" and r["ranks"] == 2
             and r["nbytes"] <= 65536]
    worst_us = max(r["us"]["tpkit shm"] for r in small) if small else None
    worst_x = min(r["us"]["gloo"] / r["us"]["tpkit shm"] for r in small) if small else None
    ds_rows = [r for r in rows if "DeepSpeed shm" in r["us"]]
    worst_ds = min((r["us"]["DeepSpeed shm"] / r["us"]["tpkit shm"] for r in ds_rows),
                   default=None)
    verdict = dict(
        all_reduce_64k_us=dict(target=TARGET_US, worst=worst_us,
                               met=worst_us is not None and worst_us <= TARGET_US),
        all_reduce_64k_vs_gloo=dict(target=TARGET_X_GLOO, worst=worst_x,
                                    met=worst_x is not None and worst_x >= TARGET_X_GLOO),
        never_slower_than_deepspeed=dict(target=1.0, worst=worst_ds,
                                         met=None if worst_ds is None else worst_ds >= 1.0))
    for name, v in verdict.items():
        print(f"  {name}: target {v['target']}, worst {v['worst']}, met: {v['met']}")
    return verdict


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2", help="comma-separated rank counts (2, 4)")
    args = p.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    budget = args.budget or (0.3 if args.quick else 1.0)
    rows, why = [], {}
    for n in (int(r) for r in args.ranks.split(",")):
        got = spawn(_worker, n, sizes, budget, mesh=dict(tp=n, comm="shm"), threads=1,
                    timeout=3600, env={"LOCAL_SIZE": str(n)})[0]  # DeepSpeed's shm needs it
        rows += got[:-1]
        if got[-1]["deepspeed"]:
            why[n] = got[-1]["deepspeed"]
    for n, reason in why.items():
        print(f"DeepSpeed skipped at {n} ranks: {reason}")
    verdict = report(rows)
    path = write_json("collectives", dict(environment=environment(), rows=rows,
                                          deepspeed_skipped=why, verdict=verdict))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
