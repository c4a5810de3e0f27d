"""Predicted (tpkit.plan + the calibrated `local` profile) against measured full training steps.

    tpkit calibrate --out /tmp/local.toml
    python benchmarks/plan_vs_measured.py --hardware-file /tmp/local.toml [--steps 12]

Trains the real tpkit model with `tpkit.train.loop.train` at (tp, pp, dp) = (1,1,1),
(2,1,1), (1,2,1), (1,1,2), (2,2,1), (2,1,2) on local gloo processes, one thread each (one
"device" of the local profile), and takes the median of the loop's own `step_s` after
the warm-up steps. The planner predicts the same run: same model, sequence, global
batch, micro-batches, no recomputation, and the dp all-reduce after the backward (the
loop does not overlap it). Prints both with the error and writes
bench-results/plan_vs_measured.json. Two models: gpt2-tiny (h = 64: dispatch-bound)
and a wider one (h = 256, 4 layers: GEMM-bound).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from tpkit.plan.hardware import Hardware, get_hardware
from tpkit.plan.simulate import Cluster, Estimate, Layout, evaluate
from tpkit.spec.config import ModelConfig, get_preset

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2)]
MODELS = {
    "gpt2-tiny": get_preset("gpt2-tiny"),
    "h256-l4": ModelConfig(name="h256-l4", vocab_size=256, hidden=256, num_layers=4,
                           num_heads=4, max_seq_len=128),
}
RESULTS = Path("bench-results/plan_vs_measured.json")


def predict(c: ModelConfig, hw: Hardware, tp: int, pp: int, dp: int, seq: int,
            global_batch: int, micro_batches: int) -> Estimate:
    """The planner's step for this run on tp*pp*dp local processes (one node)."""
    layout = Layout(tp, pp, dp, global_batch // (dp * micro_batches), recompute="none")
    cluster = Cluster(hw, nodes=1, devices_per_node=tp * pp * dp, overlap_dp=False)
    return evaluate(c, seq, global_batch, layout, cluster)


def _train_worker(mesh, run: dict, model: dict | None) -> None:
    from tpkit.model import Transformer
    from tpkit.train.config import TrainConfig
    from tpkit.train.loop import train

    cfg = TrainConfig(**run)
    built = Transformer(ModelConfig(**model), mesh, seed=cfg.seed) if model else None
    train(cfg, mesh, built)


def measure_train_step(c: ModelConfig, tp: int, pp: int, dp: int, seq: int, global_batch: int,
                       micro_batches: int, steps: int, warmup: int) -> list[float]:
    """Seconds of each step after `warmup`, from the loop's metrics.jsonl (rank 0's `step_s`;
    every step ends in all-reduces over all ranks, so rank 0 waits for the slowest)."""
    from tpkit.launch import spawn

    preset = "gpt2-tiny"  # its data (bytes, vocab 256); another model is built and passed in
    with tempfile.TemporaryDirectory() as out:
        run = dict(preset=preset, tp=tp, pp=pp, dp=dp, steps=steps, seq=seq,
                   global_batch=global_batch, micro_batches=micro_batches, out=out,
                   warmup=1, val_fraction=0.0, progress=False, plot=False, checkpoint=False)
        model = None if c == get_preset(preset) else c.to_dict()
        spawn(_train_worker, tp * pp * dp, run, model, mesh=dict(tp=tp, pp=pp, dp=dp),
              threads=1, timeout=900)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().split("\n")
                if line]
    return [r["step_s"] for r in rows[warmup:]]


def compare(name: str, hw: Hardware, args: argparse.Namespace) -> list[dict]:
    """Measure and predict every layout of one model; print a row each."""
    c, out = MODELS[name], []
    for tp, pp, dp in LAYOUTS:
        load = os.getloadavg()[0]
        steps = measure_train_step(c, tp, pp, dp, args.seq, args.global_batch,
                                   args.micro_batches, args.steps, args.warmup)
        e = predict(c, hw, tp, pp, dp, args.seq, args.global_batch, args.micro_batches)
        measured, pred = statistics.median(steps), e.step_time_s
        terms = {k: round(v * 1e3, 2) for k, v in e.terms.items() if v}
        out.append(dict(model=name, tp=tp, pp=pp, dp=dp, micro_batch=e.layout.micro_batch,
                        predicted_ms=pred * 1e3, measured_ms=measured * 1e3,
                        error=pred / measured - 1, steps_ms=[s * 1e3 for s in steps],
                        load_before=load, predicted_terms_ms=terms))
        parts = " ".join(f"{k} {v:.0f}" for k, v in terms.items())
        print(f"{name:>10} {tp:>3} {pp:>3} {dp:>3} {pred * 1e3:>9.1f} {measured * 1e3:>9.1f} "
              f"{pred / measured - 1:>+7.0%} {load:>5.2f}   {parts}", flush=True)
    return out


def main() -> None:
    """Print predicted vs measured step times and their errors; write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware-file", help="profile file from `tpkit calibrate --out`")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4, help="per step and replica")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    hw = get_hardware("local", args.hardware_file)
    a = hw.accelerator
    print(f"profile: {a.peak_flops / 1e9:.1f} GFLOP/s per core (d_half {a.gemm_half_dim:.0f}), "
          f"elementwise {a.mem_bandwidth / 1e9:.1f} GB/s, dispatch {a.op_overhead * 1e6:.1f} us/op,"
          f" all-reduce alpha {hw.intra.latency * 1e6:.0f} us, {hw.intra.bandwidth / 1e9:.2f} "
          f"GB/s, {hw.cores_per_node} cores (shared alpha {hw.shared_latency * 1e6:.0f} us)")
    print(f"seq {args.seq}, global batch {args.global_batch}, {args.micro_batches} micro-batches"
          f" per replica; median of {args.steps - args.warmup} steps after {args.warmup}")
    print(f"{'model':>10} {'tp':>3} {'pp':>3} {'dp':>3} {'pred ms':>9} {'meas ms':>9} "
          f"{'error':>7} {'load':>5}   predicted terms (ms)")
    t0, rows = time.time(), []
    for name in args.models.split(","):
        rows += compare(name, hw, args)
    errs = [abs(r["error"]) for r in rows]
    print(f"{sum(e <= 0.25 for e in errs)} of {len(errs)} within +-25%; mean |error| "
          f"{statistics.mean(errs):.0%}, worst {max(errs):.0%}; load average now "
          f"{os.getloadavg()[0]:.2f} ({time.time() - t0:.0f} s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(
        profile=dict(peak_gflops=a.peak_flops / 1e9, d_half=a.gemm_half_dim,
                     elementwise_gbs=a.mem_bandwidth / 1e9, op_overhead_us=a.op_overhead * 1e6,
                     alpha_us=hw.intra.latency * 1e6, bandwidth_gbs=hw.intra.bandwidth / 1e9,
                     cores=hw.cores_per_node, shared_latency_us=hw.shared_latency * 1e6),
        run=dict(seq=args.seq, global_batch=args.global_batch,
                 micro_batches=args.micro_batches, steps=args.steps, warmup=args.warmup),
        rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
