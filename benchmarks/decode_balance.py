"""Which rank of a tp=2 decode waits for the other, at each of its collectives: the
serving engine on rank 0, `Runner.follow` on rank 1, GPT-2 124M shape (random weights,
or --folder), greedy, batch 1, several fresh runs.

    .venv/bin/python benchmarks/decode_balance.py [--folder HF_DIR] [--runs 3] [--tokens 64]

A step's native layer stack meets the other rank 26 times: the embedding's all-reduce,
two all-reduces a layer (after attention, after the MLP) and the all-gather of each
rank's best token after the head. For each, the ledger's spans give when each rank
arrived; after the previous meet both left together, so the difference of arrival
times is how much longer one rank computed that segment. Per run: the mean of rank 1's
arrival minus rank 0's (negative: rank 0 was the slower) over the attention segments,
the MLP segments and the head, and each rank's time inside the collectives per step
(its waiting, mostly); then the distribution of one collective's time inside (median,
p90, p99, max) and the time counted from the later rank's arrival (the exchange itself,
a few us, plus any wake-up of a rank that had gone to sleep, or of its virtual CPU).
Threads at tp=1 share each product's columns out dynamically, so a slower core simply
takes fewer; two ranks with fixed halves cannot: whichever is slower in a segment sets
its pace.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch


def _case(mesh, folder: str, tokens: int) -> list[tuple[str, float, float]]:
    from tpkit.comm import collectives
    from tpkit.decode import native
    from tpkit.serve import Engine, SamplingParams
    from tpkit.serve.runner import Runner
    from tpkit.weights.sources import load_model, open_source

    spans: list[tuple[str, float, float]] = []
    record = collectives.record_native

    def keep(group, op, x, got, scopes, phase="forward"):
        spans.extend((str(sc or op), a, b) for (a, b), sc in zip(got, scopes))
        return record(group, op, x, got, scopes, phase)

    native.collectives.record_native = keep
    model = load_model(open_source(folder), mesh, dtype=torch.float32, decode=True)
    for _ in range(2):  # the first run warms up
        spans.clear()
        if mesh.tp_rank != 0:
            Runner(model).follow()
        else:
            engine = Engine(model, max_batch=1, max_len=128)
            engine.submit(list(range(1, 17)), SamplingParams(max_tokens=tokens,
                                                              temperature=0.0,
                                                              ignore_eos=True))
            while engine.busy:
                engine.step()
            engine.runner.lead_stop()
    return spans


def one_run(folder: str, tokens: int) -> dict[str, float]:
    from tpkit.launch import spawn

    r0, r1 = spawn(_case, 2, folder, tokens, mesh=dict(tp=2), timeout=600)
    per = 26  # collectives a step: 2 a layer (12 layers), the embedding's, the gather
    steps = min(len(r0), len(r1)) // per
    late: dict[str, list[float]] = {"attention": [], "mlp": [], "head": []}
    inside = [0.0, 0.0]
    waits: list[list[float]] = [[], []]  # each collective's time inside it, us, per rank
    after = [0.0, 0.0]  # ... counted from the later arrival: the exchange, and any wake-up
    for s in range(5, steps):  # the first steps: the prompt, the caches warming
        for i in range(s * per, (s + 1) * per):
            (_, a0, e0), (_, a1, e1) = r0[i], r1[i]
            k = i % per
            kind = "head" if k == per - 1 else None if k == per - 2 else \
                "attention" if k % 2 == 0 else "mlp"
            if kind:
                late[kind].append((a1 - a0) * 1e3)
            inside[0] += e0 - a0
            inside[1] += e1 - a1
            waits[0].append((e0 - a0) * 1e6)
            waits[1].append((e1 - a1) * 1e6)
            after[0] += e0 - max(a0, a1)
            after[1] += e1 - max(a0, a1)
    n = steps - 5
    tails = {}
    for r in (0, 1):
        w = sorted(waits[r])
        tails[f"rank{r}_p"] = [w[int(q * (len(w) - 1))] for q in (0.5, 0.9, 0.99)] + [w[-1]]
    return {**{k: statistics.mean(v) for k, v in late.items()}, **tails,
            "rank0_ms": inside[0] / n * 1e3, "rank1_ms": inside[1] / n * 1e3,
            "rank0_after_ms": after[0] / n * 1e3, "rank1_after_ms": after[1] / n * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", default=None, help="a GPT-2 HF folder (default: a random one)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    folder = a.folder
    if folder is None:
        from decode_profile import save_gpt2
        folder = str(save_gpt2(Path(tempfile.mkdtemp())))
    print("rank 1's arrival - rank 0's, ms a segment (mean; < 0: rank 0 slower) | time "
          "inside the collectives a step, ms")
    for r in range(a.runs):
        m = one_run(folder, a.tokens)
        print(f"run {r + 1}: attention {m['attention']:+.3f}  mlp {m['mlp']:+.3f}  head "
              f"{m['head']:+.3f} | rank 0 {m['rank0_ms']:.2f}  rank 1 {m['rank1_ms']:.2f}",
              flush=True)
        for k in (0, 1):
            p = m[f"rank{k}_p"]
            print(f"       rank {k}: a collective's time inside, us: median {p[0]:.0f}, p90 "
                  f"{p[1]:.0f}, p99 {p[2]:.0f}, max {p[3]:.0f}; after both had arrived "
                  f"{m[f'rank{k}_after_ms']:.2f} ms a step", flush=True)


if __name__ == "__main__":
    main()
