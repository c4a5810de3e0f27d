"""The pipeline bubble measured on the wall clock: 1F1B against interleaved 1F1B.

    .venv/bin/python benchmarks/pipeline_bubble.py [--tf 0.02]

Two pipeline stages (gloo processes) whose chunks' compute is a known sleep (forward
tf/v seconds, backward twice that), so the idle time is the schedule's alone; printed
next to the theories (p-1)/m and (p-1)/(v m). On a machine shared with other work the
figures move; the exact check of the schedule is the event simulation in
tests/test_interleaved.py.
"""

from __future__ import annotations

import argparse
import time

import torch

from tpkit.launch import spawn
from tpkit.parallel import (
    MicroBatch,
    StageLink,
    ring_backward_group,
    run_schedule,
)
from tpkit.spec.theory import bubble_theory


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.seconds)  # backward costs twice the forward
        return g, None


class SleepStages(torch.nn.Module):
    """A pipeline stage of v chunks; each chunk's forward sleeps `tf / v` seconds."""

    def __init__(self, mesh, v: int, tf: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.virtual_stages, self.tf, self.mesh = v, tf, mesh

    def chunk_is_first(self, c: int) -> bool:
        return self.mesh.pp_rank == 0 and c == 0

    def chunk_is_last(self, c: int) -> bool:
        return self.mesh.pp_rank == self.mesh.pp_size - 1 and c == self.virtual_stages - 1

    def activation_shape(self, b: int, s: int) -> tuple[int, int, int]:
        return (b, s, 4)

    def forward_chunk(self, c: int, x: torch.Tensor) -> torch.Tensor:
        if self.chunk_is_first(c):
            x = self.w * torch.ones(*x.shape, 4)  # [b, s, 4]
        return _Sleep.apply(x, self.tf / self.virtual_stages)

    def loss(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return out.mean()


def _measure_bubbles(mesh, tf: float) -> dict:
    back = ring_backward_group(mesh)
    out = {}
    for m in (2, 4):
        micro = [MicroBatch(torch.zeros(1, 2, dtype=torch.long),
                            torch.zeros(1, 2, dtype=torch.long)) for _ in range(m)]
        for name, v in (("1f1b", 1), ("interleaved", 2)):
            link = StageLink(mesh.pp_group, backward_group=back if v > 1 else None)
            model = SleepStages(mesh, v, tf)
            run_schedule(name, model, link, micro)  # warm-up: connections, allocations
            torch.distributed.barrier()
            t0 = time.perf_counter()
            run_schedule(name, model, link, micro)
            torch.distributed.barrier()  # the step ends when the slowest stage does
            span, busy = time.perf_counter() - t0, m * 3 * tf
            out[(name, m)] = (span - busy) / busy
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="pipeline bubble, 1F1B vs interleaved")
    p.add_argument("--tf", type=float, default=0.02, help="forward seconds per stage")
    p.add_argument("--quick", action="store_true", help="accepted for run_all.py; already short")
    a = p.parse_args()
    per_stage = spawn(_measure_bubbles, 2, a.tf, mesh=dict(tp=1, pp=2, dp=1), threads=1)
    got = {k: max(r[k] for r in per_stage) for k in per_stage[0]}
    for m in (2, 4):
        f, i = got[("1f1b", m)], got[("interleaved", m)]
        print(f"pp=2 m={m}: 1F1B {f:.3f} (theory {bubble_theory(2, m):.3f}), "
              f"interleaved v=2 {i:.3f} (theory {bubble_theory(2, m, 2):.3f})")


if __name__ == "__main__":
    main()
