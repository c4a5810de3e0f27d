"""What the default checkpoints cost a run, on 4 spawned gloo processes (tp=2 x pp=2):

    save / 500 steps    one save (every rank's shards, the manifest, retention; the
                        slowest rank's, all wait for it) over the steps between two
                        saves at the default interval (--ckpt-every 500; the 10-minute
                        clock only saves sooner where a step takes over 1.2 s, and then
                        costs one save per 10 minutes)
    agreement / steps   the step boundary's agreement (one all-reduce of three numbers
                        over every rank: a stop signal, rank 0's clock, the step time),
                        run a second time right after the first (the ranks already level:
                        its latency, not the wait for the slowest rank, which the next
                        step would wait anyway), over the steps between two agreements
                        (`loop.AGREE_S`: at most ~5 a second)

A run of `--steps` steps saving every `--every`; medians, the slowest rank's.

    .venv/bin/python benchmarks/checkpoint_cost.py            # gpt2-tiny and llama-tiny

Writes bench-results/checkpoint_cost.json.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time

from common import environment, parser, print_table, write_json
from tpkit.launch import spawn
from tpkit.train import loop
from tpkit.train.config import TrainConfig


def _timed(fn, seconds: list[float], twice: bool = False):
    def timed(*args, **kw):
        out = fn(*args, **kw) if twice else None
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        seconds.append(time.perf_counter() - t0)
        return out

    return timed


def _timed_run(mesh, cfg: TrainConfig) -> tuple[float, float, float]:
    """(median later step seconds, median save seconds, median agreement seconds)."""
    saves, agreements = [], []
    loop.save_checkpoint = _timed(loop.save_checkpoint, saves)
    loop.agree = _timed(loop.agree, agreements, twice=True)
    summary = loop.train(cfg, mesh)
    return summary.later_step_s, statistics.median(saves), statistics.median(agreements)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    a = p.parse_args()
    rows, out = [], {"environment": environment(), "load_average": os.getloadavg()}
    for preset in ("gpt2-tiny", "llama-tiny"):
        with tempfile.TemporaryDirectory() as d:
            cfg = TrainConfig(preset=preset, tp=2, pp=2, micro_batches=2, steps=a.steps,
                              ckpt_every=a.every, ckpt_minutes=0, out=d, log="none",
                              progress=False, plot=False, eval_every=0)
            per_rank = spawn(_timed_run, 4, cfg, mesh=dict(tp=2, pp=2), threads=1)
        step_s = statistics.median(r[0] for r in per_rank)
        save_s, agree_s = (max(r[i] for r in per_rank) for i in (1, 2))
        share = save_s / (500 * step_s)
        between = max(1, math.ceil(loop.AGREE_S / step_s)) * step_s
        rows.append([preset, f"{step_s * 1e3:.1f}", f"{save_s * 1e3:.1f}", f"{share:.2%}",
                     f"{agree_s * 1e3:.2f}", f"{agree_s / between:.2%}"])
        out[preset] = dict(step_s=step_s, save_s=save_s, share_at_500=share,
                           agreement_s=agree_s)
    print_table("the default checkpoints' cost", ["model (tp=2 x pp=2)", "step ms", "save ms",
                "save / 500 steps", "agreement ms", "agreement / steps"], rows)
    print(f"load average {os.getloadavg()[0]:.2f} (before: {out['load_average'][0]:.2f})")
    write_json("checkpoint_cost", out)


if __name__ == "__main__":
    main()
