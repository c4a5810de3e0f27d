"""What the default checkpoints cost a run: the seconds of one save (every rank's shards,
the manifest, retention) over the seconds of the steps between two saves, at the
default interval (--ckpt-every 500; the 10-minute clock only saves sooner on a machine
slower than 1.2 s a step, where its share is that of one save in 10 minutes).

A run of `--steps` steps saving every `--every` steps on 4 spawned gloo processes
(tp=2 x pp=2); each save timed on every rank (the slowest counts: all wait for it), the
step time the median of the later steps.

    .venv/bin/python benchmarks/checkpoint_cost.py            # gpt2-tiny and llama-tiny

Writes bench-results/checkpoint_cost.json.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from common import environment, parser, print_table, write_json
from tpkit.launch import spawn
from tpkit.train import loop
from tpkit.train.config import TrainConfig


def _timed_run(mesh, cfg: TrainConfig) -> tuple[float, list[float]]:
    """(median later step seconds, seconds of each save) on this rank."""
    saves, save = [], loop.save_checkpoint

    def timed(*args, **kw):
        t0 = time.perf_counter()
        out = save(*args, **kw)
        saves.append(time.perf_counter() - t0)
        return out

    loop.save_checkpoint = timed
    summary = loop.train(cfg, mesh)
    return summary.later_step_s, saves


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=40)
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
        save_s = statistics.median(max(r[1][i] for r in per_rank)
                                   for i in range(len(per_rank[0][1])))
        share = save_s / (500 * step_s)
        rows.append([preset, f"{step_s * 1e3:.1f}", f"{save_s * 1e3:.1f}", f"{share:.2%}"])
        out[preset] = dict(step_s=step_s, save_s=save_s, share_at_500=share)
    print_table("a checkpoint at the default interval", ["model (tp=2 x pp=2)", "step ms", "save ms", "save / 500 steps"], rows)
    print(f"load average {os.getloadavg()[0]:.2f}")
    write_json("checkpoint_cost", out)


if __name__ == "__main__":
    main()
