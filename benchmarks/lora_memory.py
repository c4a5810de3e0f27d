"""Memory of training with and without LoRA: what a rank holds (weights, gradients,
AdamW's state) and the process's peak resident memory, on SmolLM2-135M's shape (30
layers, hidden 576, 9 heads / 3 kv heads, ffn 1536, vocabulary 49152, tied), random
weights, float32, tp=1, CPU.

    PYTHONPATH=src .venv/bin/python benchmarks/lora_memory.py [--seq 512] [--batch 2]

Each variant runs in a fresh process (its peak RSS its own): the model built as `tpkit
train` builds it, the optimizer `tpkit train` makes (`train.optim.build_optimizer`:
only parameters that take gradients), 4 steps of forward, backward and AdamW; then
the bytes of the weights, of the gradients still held after backward, of the
optimizer's state, the peak RSS (ru_maxrss), and tokens/s (the median of the steps
after the first: the variants run one after the other, so a busy machine moves them).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from common import environment, parser, print_table, write_json

SMOLLM2 = dict(name="smollm2-135m-shape", family="llama", vocab_size=49152, hidden=576,
               num_layers=30, num_heads=9, kv_heads=3, ffn=1536, max_seq_len=2048,
               norm="rmsnorm", activation="swiglu", position="rope", bias=False,
               tie_embeddings=True)
VARIANTS = {"full fine-tune": {}, "LoRA r=8 q,k,v,o": dict(lora_rank=8, lora_targets="q,k,v,o"),
            "LoRA r=16 all 7": dict(lora_rank=16, lora_targets="q,k,v,o,gate,up,down")}
STEPS = 4  # the first one's time is left out


def measure(variant: str, seq: int, batch: int) -> dict:
    """One variant's bytes and peak RSS (call in a fresh process)."""
    import torch

    from tpkit.mesh import ParallelMesh
    from tpkit.model import Transformer
    from tpkit.spec.config import ModelConfig
    from tpkit.train.config import TrainConfig
    from tpkit.train.optim import build_optimizer

    torch.manual_seed(0)
    cfg = TrainConfig(**VARIANTS[variant])
    config = cfg.adapted(ModelConfig(**SMOLLM2))
    mesh = ParallelMesh.single()
    model = Transformer(config, mesh)
    opt = build_optimizer(model, cfg, mesh)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1))
    grads, times = 0, []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                    if p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if torch.is_tensor(v))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return dict(variant=variant, params=sum(p.numel() for p in model.parameters()),
                trainable=trainable, weights=model.param_bytes(), grads=grads,
                optimizer=state, peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                * 1024, tokens_per_s=batch * seq / statistics.median(times[1:]))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--one", help=argparse.SUPPRESS)  # (internal) measure this variant
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.seq, args.batch)))
        return
    rows = []
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--one", variant, "--seq", str(args.seq),
                              "--batch", str(args.batch)], capture_output=True, text=True,
                             check=True)
        rows.append(json.loads(out.stdout.splitlines()[-1]))
    mib = 2 ** 20
    print_table(f"training memory, SmolLM2-135M shape, fp32, tp=1, {args.batch} x {args.seq} "
                f"tokens", ["variant", "trainable", "weights", "gradients", "AdamW state",
                            "peak RSS", "tokens/s"],
                [[r["variant"], f"{r['trainable']:,}", f"{r['weights'] / mib:,.0f} MiB",
                  f"{r['grads'] / mib:,.1f} MiB", f"{r['optimizer'] / mib:,.1f} MiB",
                  f"{r['peak_rss'] / mib:,.0f} MiB", f"{r['tokens_per_s']:,.0f}"] for r in rows])
    write_json("lora_memory", dict(environment=environment(), seq=args.seq, batch=args.batch,
                                   rows=rows))


if __name__ == "__main__":
    main()
