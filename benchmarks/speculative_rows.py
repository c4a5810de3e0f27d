"""What a verify step of speculation costs, alone: the engine's decode step with r extra
rows (proposed tokens, all rejected) against the same step without them (issue 49's
never-lose rule: a proposal is worth its rows only if the expected accepted tokens pay
for them).

    .venv/bin/python benchmarks/speculative_rows.py --hf SMOLLM2 [--rounds 5] [--seqs 1,4]

For each dtype (float32, bfloat16) and number of sequences decoding together, the
engine (tp=1, no tokenizer: no end of sequence) generates `--new` tokens per sequence
with a proposer that gives every sequence `extra / seqs` wrong tokens per step (the
same token again: rejected, one token per step as without speculation) and without
one; each figure is the median over the rounds (contenders alternated) of the seconds
per step, and the ratio to the step without extra rows. Prints the cost per extra row
relative to the step without (what `serve.speculate.StepCost` measures online in the
engine). On a loaded machine the figures are noise (docs/benchmarks_history.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import tpkit
from tpkit.serve import Engine, SamplingParams
from tpkit.serve.speculate import Speculator


class Wrong(Speculator):
    """Proposes `k` copies of the sequence's last token every `every`-th step,
    unadapted."""

    def __init__(self, k: int, every: int = 1) -> None:
        super().__init__(max(k, 1))
        self.k, self.every, self.steps = k, every, 0

    def propose(self, decodes, spare, room):
        out = {}
        self.steps += 1
        if self.steps % self.every:
            return out
        for req in decodes:
            k = min(self.k, spare, req.params.max_tokens - len(req.tokens) - 1)
            if k > 0:
                k = min(k, room(req, req.computed + 1 + k) - req.computed - 1)
                last = (req.prompt + req.tokens)[-1]
                out[req.id], spare = [last] * k, spare - k
        return out


def per_step(model, seqs: int, k: int, new: int, every: int = 1) -> float:
    """Seconds per engine step, `seqs` sequences generating `new` tokens, `k` wrong
    proposed tokens each every `every`-th step (0: no speculation)."""
    engine = Engine(model, max_batch=8, max_len=512,
                    speculator=Wrong(k, every) if k else None)
    prompts = [[1 + (7 * i + j) % 400 for j in range(40)] for i in range(seqs)]
    for p in prompts:
        engine.submit(p, SamplingParams(max_tokens=new))
    while any(r.computed < len(r.prompt) for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()  # the prompts: not timed
    steps, t0 = 0, time.perf_counter()
    while engine.busy:
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="a Hugging Face folder (SmolLM2-135M)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seqs", default="1,4")
    p.add_argument("--new", type=int, default=48)
    args = p.parse_args()
    print(f"load average before: {os.getloadavg()}")
    for dtype in ("float32", "bfloat16"):
        model = tpkit.load(args.hf, tp=1, dtype=getattr(torch, dtype), decode=True)
        for seqs in map(int, args.seqs.split(",")):
            ks = [k for k in (0, 1, 2, 3, 4, 7) if seqs * k <= 8 - seqs or k == 0]
            times = {k: [] for k in ks}
            per_step(model, seqs, 0, 8)  # warm
            for r in range(args.rounds):
                for k in ks[r % len(ks):] + ks[:r % len(ks)]:
                    times[k].append(per_step(model, seqs, k, args.new))
            base = statistics.median(times[0])
            for k in ks:
                t = statistics.median(times[k])
                extra = seqs * k
                row = (t / base - 1) / extra if extra else 0.0
                print(f"{dtype:8} seqs={seqs} extra_rows={extra}: {1e3 * t:7.2f} ms/step "
                      f"x{t / base:.3f}  per extra row {row:+.3f} of a step", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
