"""`tpkit calibrate`: measure this machine into a hardware profile called `local`.

    matmul      float32, the 3 GEMMs of a linear layer of smallest side d = 16..1024, one
                thread, then all threads;
                fit  1/rate = 1/peak + (d_half/peak) (1/d)   (the planner's GEMM model)
    elementwise a layer's mix at activation size (layer norm, tanh-GELU on the 4h MLP
                activation, residual add): the bytes/s elementwise kernels get
    dispatch    a chain of tiny multiplies, forward + backward: seconds per dispatched op
    all-reduce  gloo, p = 2 and 4 local processes (at most one per core), 4 KiB .. 16 MiB;
                least squares fit of t = 2(p-1) alpha + 2(p-1)/p n / B (the ring model);
                then 2 x cores processes in pairs: the latency of a step when processes
                outnumber cores and a peer must first be scheduled

A "device" of the local profile is one process with one thread (how `tpkit.launch` runs
tests with `threads=1`). The profile goes to ~/.cache/tpkit/local.toml (or --out) and
`tpkit plan --hardware local` reads it. The measuring is `tpkit.check.measure` (torch, local
processes); the fits are pure Python (`tpkit.plan.fit`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from tpkit.check.measure import (
    measure_all_reduce,
    measure_matmul,
    measure_memory_bandwidth,
    measure_op_overhead,
    measure_shared_latency,
)
from tpkit.commands.common import deprecated_alias
from tpkit.plan.fit import build_profile, fit_alpha_beta, notes, ram_bytes
from tpkit.plan.hardware import GB, default_local_path, profile_to_toml


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `tpkit calibrate`."""
    p.add_argument("--out", help=f"profile file (default {default_local_path()})")
    processes = p.add_argument("--processes", type=int, default=2,
                               help="processes for the all-reduce fit (4 as well, up to the "
                                    "cores)")
    deprecated_alias(p, processes, "--nproc")
    p.add_argument("--reps", type=int, default=30, help="timed all-reduces per size")


def run(args: argparse.Namespace) -> int:
    """Measure, fit, write the profile, print what was found."""
    cores = os.cpu_count() or 1
    print(f"matmul, float32, 1 thread and {cores} threads ...", flush=True)
    one, allt = measure_matmul(1), measure_matmul(cores)
    mem_bw, op_s = measure_memory_bandwidth(), measure_op_overhead()
    samples = []
    for p in sorted({p for p in (args.processes, 4) if p <= max(cores, 2)}):
        print(f"all-reduce on {p} gloo processes ...", flush=True)
        samples += measure_all_reduce(p, reps=args.reps)
    alpha, bw = fit_alpha_beta(samples)
    shared = measure_shared_latency(cores, args.reps)
    hw = build_profile(one, mem_bw, alpha, bw, ram_bytes(), cores, op_s, shared)
    lines = notes(one, allt, samples, alpha, bw) + [
        f"elementwise {mem_bw / GB:.2f} GB/s, dispatch {op_s * 1e6:.2f} us per op, "
        f"all-reduce step with {2 * cores} processes on {cores} cores {shared * 1e6:.0f} us"]
    out = Path(args.out) if args.out else default_local_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# tpkit calibrate, {time.strftime('%Y-%m-%d %H:%M')}, {cores} cores\n"
                   + "".join(f"# {line}\n" for line in lines) + profile_to_toml(hw))
    print("\n".join(lines) + f"\nwrote {out}; use `tpkit plan --hardware local"
          + ("" if out == default_local_path() else f" --hardware-file {out}") + "`")
    return 0
