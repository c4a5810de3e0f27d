"""Sequence parallelism on a sequence tp does not divide: what the padding costs.

At tp=2 with SP, one training step (forward, loss, backward) of a 2-layer model of
SmolLM2-135M's width (hidden 576, 9 heads, 3 kv heads, ffn 1536) on b x s tokens, for
s = N (even: N/2 + N/2) and s = N - 1 (uneven: N/2 + N/2 - 1, every SP collective
padded to N rows), alternating in rounds on the same two ranks (one thread each). The
uneven step moves the padded bytes of the even one (`spec.shapes.sp_padded_seq`) and
does one token less of work: its time per token against the even one's is the cost.

    .venv/bin/python benchmarks/sp_uneven.py              # N = 128, 256; 15 rounds
    .venv/bin/python benchmarks/sp_uneven.py --quick      # N = 64; 3 rounds (smoke)

Writes bench-results/sp_uneven.json.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from common import (
    Contender,
    environment,
    median_ms,
    parser,
    print_table,
    round_robin,
    write_json,
)
from tpkit.launch import spawn
from tpkit.model import Transformer
from tpkit.spec import ModelConfig

CFG = ModelConfig(name="smol-2l", vocab_size=49152, hidden=576, num_layers=2, num_heads=9,
                  kv_heads=3, ffn=1536, max_seq_len=1024, norm="rmsnorm",
                  activation="swiglu", position="rope", bias=False, tie_embeddings=True)
B = 4


def _step(model, ids, labels):
    def run() -> None:
        model.zero_grad(set_to_none=True)
        model.loss(model(ids), labels).backward()
    return run


def _worker(mesh, lengths: list[int], reps: int) -> dict:
    model = Transformer(CFG, mesh, seed=0, sequence_parallel=True).train()
    g = torch.Generator().manual_seed(0)
    contenders = []
    for n in lengths:
        for s in (n, n - 1):
            ids = torch.randint(0, CFG.vocab_size, (B, s), generator=g)
            contenders.append(Contender(f"s={s}", _step(model, ids, torch.roll(ids, -1, 1))))
    mesh.ledger.enabled = False
    times = round_robin(contenders, reps, sync=dist.barrier, warmup=2)
    return {name: ts for name, ts in times.items()}


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    lengths, reps = ([64], 3) if args.quick else ([128, 256], 15)
    load0 = os.getloadavg()
    times = spawn(_worker, 2, lengths, reps, mesh=dict(tp=2), threads=1, timeout=1800)[0]
    load1 = os.getloadavg()
    rows, out = [], {}
    for n in lengths:
        even, odd = median_ms(times[f"s={n}"]), median_ms(times[f"s={n - 1}"])
        cost = (odd / (n - 1)) / (even / n) - 1  # per token, uneven against even
        out[n] = dict(even_ms=even, uneven_ms=odd, per_token_cost=cost)
        rows.append([str(n), f"{even:.1f}", str(n - 1), f"{odd:.1f}", f"{100 * cost:+.1f}%"])
    load = f"load {load0[0]:.1f} -> {load1[0]:.1f}"
    print_table(f"SP at tp=2, b={B}, one training step, medians of {reps} alternating rounds "
                f"({load})", ["s even", "ms", "s uneven", "ms", "per token, uneven vs even"],
                rows)
    write_json("sp_uneven", dict(environment=environment(), load=[load0, load1], reps=reps,
                                 batch=B, results=out, times=times))


if __name__ == "__main__":
    main()
