"""GPU check (one CUDA GPU): the library's CUDA path against its CPU path, and the
throughput of bf16 training on the GPU. Not part of the test suite (CI has no GPU).

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--out DIR] [--steps 20]

1. gpt2-tiny, llama-tiny (GQA) and bert-tiny built from one seed on cuda and on cpu:
   max |logits| and |grad| differences (float32, TF32 off), forward + backward.
2. `tpkit.train.loop.train` of gpt2-124m, gpt2-774m and llama3.2-1b (GQA, SwiGLU,
   RoPE), bf16, one GPU, in several variants (`VARIANTS`): eager autocast (the first
   wave's path), --compile, the chunked loss, and all of them with fp32 master
   weights. Median step time after warm-up, tokens/s, compile time (first step minus
   the median), and model FLOPs utilization (6 N per token plus attention, over the
   GPU's dense bf16 peak). Every row is appended to DIR/gpu_check.json as it is measured.

    --tiny --cpu   the same code path on gpt2-tiny and llama-tiny, on the CPU, in
                   seconds (what the test suite runs; MFU is then None)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tpkit.host.device import best_device
from tpkit.mesh import ParallelMesh
from tpkit.model import Transformer
from tpkit.spec import get_preset

BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}
LOSS_CHUNK = 4096  # tokens per chunk of the chunked loss (4 chunks of a 16 x 1024 batch)
VARIANTS = {  # name -> TrainConfig fields on top of bf16 autocast
    "eager": {},
    "compile": dict(compile=True),
    "chunked": dict(loss_chunk=LOSS_CHUNK),
    "compile+chunked": dict(compile=True, loss_chunk=LOSS_CHUNK),
    "compile+chunked+master": dict(compile=True, loss_chunk=LOSS_CHUNK, master_weights=True),
}
MODELS = (("gpt2-124m", 16), ("gpt2-774m", 16), ("llama3.2-1b", 8))  # (preset, batch)
TINY = (("gpt2-tiny", 4), ("llama-tiny", 4))


def cpu_vs_gpu(preset: str, device: torch.device) -> dict:
    cfg = get_preset(preset)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, dev in (("cpu", torch.device("cpu")), ("gpu", device)):
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


def throughput(preset: str, out: Path, steps: int, batch: int, seq: int, variant: str,
               device: torch.device, backend: str) -> dict:
    """Train `steps` steps of `preset` in `variant`; the median step after warm-up, MFU."""
    from tpkit.train.config import TrainConfig
    from tpkit.train.loop import train

    extra = dict(VARIANTS[variant])
    if "loss_chunk" in extra:
        extra["loss_chunk"] = min(extra["loss_chunk"], batch * seq // 2)
    folder = out / f"{preset}-{variant}"
    cfg = TrainConfig(preset=preset, steps=steps, global_batch=batch, micro_batches=1, seq=seq,
                      dtype="bfloat16", out=str(folder), progress=False, plot=False,
                      checkpoint=False, eval_every=0, val_fraction=0.0, lr=3e-4,
                      compile_backend=backend, **extra)
    t0 = time.perf_counter()
    result = train(cfg, ParallelMesh.single(device=device))
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    warm = min(3, len(rows) - 1)
    step_s = statistics.median(r["step_s"] for r in rows[warm:])
    c = get_preset(preset)
    flops_per_token = 6 * c.num_params() + 12 * c.num_layers * c.hidden * seq  # + attention
    achieved = flops_per_token * batch * seq / step_s
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor()
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    return dict(preset=preset, variant=variant, params=c.num_params(), batch=batch, seq=seq,
                step_s=step_s, tokens_per_s=batch * seq / step_s, tflops=achieved / 1e12,
                mfu=achieved / peak if peak else None, device=name,
                compile_s=rows[0]["step_s"] - step_s if cfg.compile else 0.0,
                first_loss=result.first_loss, last_loss=result.last_loss,
                wall_s=time.perf_counter() - t0)


def _line(r: dict) -> str:
    mfu = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else "MFU n/a"
    return (f"{r['preset']:<12} {r['variant']:<23} b={r['batch']} s={r['seq']}: "
            f"{r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
            f"{r['tflops']:.1f} TFLOP/s, {mfu}, compile {r['compile_s']:.0f} s; loss "
            f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results/gpu")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {tuple(VARIANTS)}")
    p.add_argument("--models", default=None, help="comma-separated presets (default: all)")
    p.add_argument("--tiny", action="store_true", help="gpt2-tiny and llama-tiny (smoke run)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny: the test)")
    p.add_argument("--compile-backend", default="inductor")
    a = p.parse_args()
    device = torch.device("cpu") if a.cpu else best_device()
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {tuple(VARIANTS)}")
    models = TINY if a.tiny else MODELS
    if a.models:
        models = [(m, b) for m, b in models if m in a.models.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(exactness=[cpu_vs_gpu(p_, device) for p_ in ("gpt2-tiny", "llama-tiny", "bert-tiny")],
                  throughput=[])
    for r in report["exactness"]:
        print(f"{r['preset']:<11} {device.type} vs cpu: logits {r['logits_diff']:.2e}, grads "
              f"{r['grad_diff']:.2e}, loss {r['loss_cpu']:.6f} / {r['loss_gpu']:.6f}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    for preset, batch in models:
        for variant in variants:
            r = throughput(preset, out, a.steps, batch, min(a.seq, get_preset(preset).max_seq_len),
                           variant, device, a.compile_backend)
            report["throughput"].append(r)
            print(_line(r), flush=True)
            (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
