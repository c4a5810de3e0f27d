"""GPU check (one CUDA GPU): the library's CUDA path against its CPU path, and the
throughput of bf16 training on the GPU. Not part of the test suite (CI has no GPU).

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--out DIR]

1. gpt2-tiny, llama-tiny (GQA) and bert-tiny built from one seed on cuda and on cpu:
   max |logits| and |grad| differences (float32, TF32 off), forward + backward.
2. `tpkit.train.loop.train` of gpt2-124m and gpt2-774m, bf16 autocast, one GPU: median
   step time after warm-up, tokens/s, and model FLOPs utilization (6 N per token plus
   attention, over the GPU's dense bf16 peak).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tpkit.device import best_device
from tpkit.mesh import ParallelMesh
from tpkit.model import Transformer
from tpkit.spec import get_preset

BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}


def cpu_vs_gpu(preset: str) -> dict:
    cfg = get_preset(preset)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, dev in (("cpu", torch.device("cpu")), ("gpu", best_device())):
        mesh = ParallelMesh.single(device=dev)
        model = Transformer(cfg, mesh, seed=3)
        x = ids.to(dev)
        types = torch.zeros_like(x) if cfg.type_vocab_size else None
        logits = model(x, token_types=types)
        loss = model.loss(logits, torch.roll(x, -1, 1))
        loss.backward()
        out[name] = (logits.detach().cpu(), loss.item(),
                     {n: p.grad.detach().cpu() for n, p in model.named_parameters()})
    (lc, sc, gc), (lg, sg, gg) = out["cpu"], out["gpu"]
    return dict(preset=preset, logits_diff=(lc - lg).abs().max().item(), loss_cpu=sc,
                loss_gpu=sg, grad_diff=max((gc[n] - gg[n]).abs().max().item() for n in gc))


def throughput(preset: str, out: Path, steps: int, batch: int, seq: int) -> dict:
    from tpkit.train.config import TrainConfig
    from tpkit.train.loop import train

    cfg = TrainConfig(preset=preset, steps=steps, global_batch=batch, micro_batches=1, seq=seq,
                      dtype="bfloat16", out=str(out / preset), progress=False, plot=False,
                      checkpoint=False, eval_every=0, lr=3e-4)
    t0 = time.perf_counter()
    result = train(cfg, ParallelMesh.single(device=best_device()))
    rows = [json.loads(line) for line in (out / preset / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(r["step_s"] for r in rows[3:])
    c = get_preset(preset)
    flops_per_token = 6 * c.num_params() + 12 * c.num_layers * c.hidden * seq  # + attention
    achieved = flops_per_token * batch * seq / step_s
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    return dict(preset=preset, params=c.num_params(), batch=batch, seq=seq, step_s=step_s,
                tokens_per_s=batch * seq / step_s, tflops=achieved / 1e12,
                mfu=achieved / peak if peak else None, gpu=name,
                first_loss=result.first_loss, last_loss=result.last_loss,
                wall_s=time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results/gpu")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(exactness=[cpu_vs_gpu(p_) for p_ in ("gpt2-tiny", "llama-tiny", "bert-tiny")])
    for r in report["exactness"]:
        print(f"{r['preset']:<11} cuda vs cpu: logits {r['logits_diff']:.2e}, grads "
              f"{r['grad_diff']:.2e}, loss {r['loss_cpu']:.6f} / {r['loss_gpu']:.6f}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    report["throughput"] = []
    for preset, batch in (("gpt2-124m", 16), ("gpt2-774m", 16)):
        r = throughput(preset, out, a.steps, batch, 1024)
        report["throughput"].append(r)
        print(f"{preset:<10} bf16 b={batch} s=1024: {r['step_s'] * 1e3:.1f} ms/step, "
              f"{r['tokens_per_s']:,.0f} tokens/s, {r['tflops']:.0f} TFLOP/s, MFU "
              f"{(r['mfu'] or 0):.1%} on {r['gpu']}; loss {r['first_loss']:.3f} -> "
              f"{r['last_loss']:.3f}", flush=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
