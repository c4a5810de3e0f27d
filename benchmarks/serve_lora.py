"""What a served LoRA adapter costs a decode step (`tpkit serve --lora`): the tokens/s of
greedy decode steps of B rows, every row the base's, against one row (and every row)
with an adapter, on SmolLM2-135M's shape (random weights, float32, tp=1, CPU): an
adapter of rank 8 on all 7 projections, and one on q, k, v, o only (no gate/up: no
fused SwiGLU computed again).

    PYTHONPATH=src .venv/bin/python benchmarks/serve_lora.py [--rows 1 8] [--steps 32]

Each variant: B requests of a 16-token prompt, run until every one decodes, then
`--steps` engine steps timed (decode rows only); the variants take turns, `--rounds`
times, and the median of each is kept (a busy machine moves them alike). A base-only
step runs in one native call (`NativeStack`); a step with an adapter row runs the
layers one by one (`NativeLayer`) and adds the adapted rows' deltas.
"""

from __future__ import annotations

import statistics
import time

from common import environment, parser, print_table, write_json
from lora_memory import SMOLLM2

RANK = 8


def engine(rows: int):
    """A decode-only SmolLM2-shaped model with one adapter, in an Engine of `rows` slots."""
    import torch

    from tpkit.decode.forms import for_decode
    from tpkit.layers.lora import layer_parts
    from tpkit.mesh import ParallelMesh
    from tpkit.model import Transformer
    from tpkit.serve import Engine
    from tpkit.serve.adapters import Adapter, Adapters, in_features
    from tpkit.spec.config import ModelConfig

    torch.manual_seed(0)
    c = ModelConfig(**SMOLLM2)
    model = for_decode(Transformer(c, ParallelMesh.single()).eval())
    tensors = {(i, path, t): (torch.randn(RANK, in_features(c, path)) * 0.02,
                              torch.randn(n, RANK) * 0.02)
               for i in range(c.num_layers) for path, parts in layer_parts(c).items()
               for t, n in parts}
    attention = {k: v for k, v in tensors.items() if k[2] in ("q", "k", "v", "o")}
    adapters = Adapters(model, [Adapter("all7", None, RANK, 2.0, tensors),
                                Adapter("qkvo", None, RANK, 2.0, attention)])
    return Engine(model, max_batch=rows, max_len=512, adapters=adapters)


def tokens_per_s(e, adapted: int, rows: int, steps: int, adapter: int = 1) -> float:
    """Decode steps of `rows` rows, the first `adapted` of them with adapter `adapter`."""
    from tpkit.serve.params import SamplingParams

    reqs = [e.submit(list(range(1 + i, 17 + i)), SamplingParams(
        max_tokens=steps + 4, ignore_eos=True, adapter=adapter if i < adapted else 0)) for i in range(rows)]
    while any(not r.tokens for r in reqs):
        e.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        e.step()
    took = time.perf_counter() - t0
    while e.step():
        pass
    return rows * steps / took


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    out = []
    for rows in args.rows:
        e = engine(rows)
        variants = {"base only": (0, 1), "one row, all 7 targets": (1, 1),
                    "one row, q,k,v,o": (1, 2)} | (
            {"every row, all 7 targets": (rows, 1)} if rows > 1 else {})
        got = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, (n, k) in variants.items():
                got[v].append(tokens_per_s(e, n, rows, args.steps, k))
        base = statistics.median(got["base only"])
        for v, xs in got.items():
            out.append(dict(rows=rows, variant=v, tokens_per_s=statistics.median(xs),
                            vs_base=statistics.median(xs) / base))
    print_table(f"greedy decode steps with a served LoRA adapter (rank {RANK}), "
                f"SmolLM2-135M shape, fp32, tp=1", ["rows", "variant", "tokens/s", "vs base"],
                [[str(r["rows"]), r["variant"], f"{r['tokens_per_s']:,.1f}",
                  f"{r['vs_base']:.2f}x"] for r in out])
    write_json("serve_lora", dict(environment=environment(), steps=args.steps,
                                  rounds=args.rounds, rows=out))


if __name__ == "__main__":
    main()
