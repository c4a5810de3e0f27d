"""Predicted (tpkit.plan cost model + the `local` profile) against measured, on this machine.

    python benchmarks/plan_vs_measured.py [--hardware-file /tmp/local.toml] [--reps 10]

Measures forward + backward of `tpkit.layers.ParallelMLP` at tp = 1, 2 on local gloo
processes (one thread each: one "device" of the local profile), and prints each
prediction next to the measurement with its error. Run `tpkit calibrate` first (or pass
the file it wrote). The full training step, for several (tp, pp, dp), waits for the
training loop: see `measure_train_step` below.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tpkit.plan import cost
from tpkit.plan.hardware import Hardware, get_hardware

SHAPES = [  # (batch, seq, hidden, ffn)
    (4, 128, 512, 2048),
    (2, 128, 1024, 4096),
]
F32 = 4


def predict_mlp(hw: Hardware, tp: int, b: int, s: int, h: int, f: int) -> dict[str, float]:
    """Seconds of one forward + backward of the Megatron MLP on one rank, by term.

    GEMMs: fc1 [bs, h] x [h, f/tp] and fc2 [bs, f/tp] x [f/tp, h], 2 b s h f / tp FLOPs
    each forward, twice that backward; GELU streams [b, s, f/tp] (read + write, forward;
    twice backward); tensor parallelism sends one all-reduce of b s h forward, one backward.
    """
    acc = hw.accelerator
    smallest = min(b * s, h, f // tp)
    gemm = cost.gemm_time(3 * 2 * (2 * b * s * h * f / tp), acc, smallest)
    elementwise = cost.memory_time(3 * 2 * b * s * (f // tp) * F32, acc)
    comm = 2 * cost.all_reduce_time(b * s * h * F32, tp, cost.link_for(tp, hw))
    return {"gemm": gemm, "elementwise": elementwise, "all_reduce": comm,
            "total": gemm + elementwise + comm}


def _mlp_worker(mesh, shape: tuple[int, int, int, int], reps: int) -> float:
    import torch
    import torch.distributed as dist

    from tpkit.layers import ParallelMLP

    b, s, h, f = shape
    mesh.ledger.enabled = False
    mlp = ParallelMLP(h, f, mesh.tp_group, activation="gelu", seed=0)
    x = torch.randn(b, s, h, requires_grad=True)
    times = []
    for i in range(reps + 2):
        if mesh.tp_group.pg is not None:
            dist.barrier(group=mesh.tp_group.pg)
        t0 = time.perf_counter()
        mlp(x).sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_mlp(tp: int, shape: tuple[int, int, int, int], reps: int) -> float:
    """Median seconds of forward + backward on `tp` one-thread gloo processes (slowest rank)."""
    from tpkit.launch import spawn

    return max(spawn(_mlp_worker, tp, shape, reps, mesh=dict(tp=tp), threads=1, timeout=600))


# ---------------------------------------------------------------------------------------------
# TODO(training loop, issue in progress): a full step of the real tpkit model.
def measure_train_step(preset: str, tp: int, pp: int, dp: int, global_batch: int,
                       seq: int) -> float:
    """Seconds per training step of `preset` at (tp, pp, dp) on local processes.

    To be written once `tpkit.train` has its loop: spawn tp*pp*dp one-thread processes,
    run a few steps, return the median step time; compare with
    `tpkit.plan.evaluate(config, seq, global_batch, Layout(tp, pp, dp, ...),
    Cluster(get_hardware("local"), nodes=1, devices_per_node=tp*pp*dp))`.
    """
    raise NotImplementedError("the training loop (tpkit.train) is not there yet; "
                              "this benchmark measures ParallelMLP for now")
# ---------------------------------------------------------------------------------------------


def main() -> None:
    """Print predicted vs measured MLP forward + backward times and their errors."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware-file", help="profile file from `tpkit calibrate --out`")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tp", default="1,2")
    args = p.parse_args()
    hw = get_hardware("local", args.hardware_file)
    print(f"profile: peak {hw.accelerator.peak_flops / 1e9:.1f} GFLOP/s per core, d_half "
          f"{hw.accelerator.gemm_half_dim:.0f}, all-reduce alpha {hw.intra.latency * 1e6:.0f} us,"
          f" {hw.intra.bandwidth / 1e9:.2f} GB/s")
    print(f"{'b,s,h,ffn':>20} {'tp':>3} {'predicted ms':>13} {'measured ms':>12} {'error':>7}"
          f"   (gemm / elementwise / all-reduce predicted ms)")
    for shape in SHAPES:
        for tp in (int(t) for t in args.tp.split(",")):
            pred = predict_mlp(hw, tp, *shape)
            meas = measure_mlp(tp, shape, args.reps)
            parts = " / ".join(f"{pred[k] * 1e3:.1f}" for k in ("gemm", "elementwise", "all_reduce"))
            print(f"{','.join(map(str, shape)):>20} {tp:>3} {pred['total'] * 1e3:>13.1f} "
                  f"{meas * 1e3:>12.1f} {pred['total'] / meas - 1:>+7.0%}   ({parts})", flush=True)


if __name__ == "__main__":
    main()
