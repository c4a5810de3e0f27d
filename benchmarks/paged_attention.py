"""The decode rows' attention: the native kernel (`kernels.paged_attention`) against the
SDPA loop it replaces (one fused attention per sequence), side by side in one run.

    .venv/bin/python benchmarks/paged_attention.py [--folder HF_DIR] [--dtype bfloat16]
                                                   [--no-long] [--quick]

1. A decode step of SmolLM2-135M (the folder's weights; without --folder, random weights
   of its shape), tp=1, loaded to decode (`load_model(..., decode=True)`): `PagedCache(m,
   16)`, 1 or 8 sequences prefilled with 40 tokens, then `paged_kv.forward(m, cache,
   [Piece([7], 40 + k, blocks)...], greedy=True)`; then 1 x 4096 and 8 x 2048 keys. The
   kernel (as by default: torch's threads; and on one thread) and SDPA alternating.
2. One layer's `attend_paged` alone (the cache writes, rotary, then the attention) on
   its own cache at 1 or 8 sequences of 45 or 4096 keys, blocks scattered: the kernel
   (both ways) against the SDPA loop.
Medians of alternating rounds (`common.round_robin`); the load average is printed and
written (bench-results/paged_attention.json): quote figures with it.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import Contender, environment, parser, print_table, reps_for, round_robin, write_json


def smollm2_shaped(folder: Path) -> Path:
    """Random weights of SmolLM2-135M's shape, saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True)).save_pretrained(folder)
    return folder


class Kernel:
    """Switch between the kernel as it runs by default (`kernel_threads()`: torch's
    OpenMP team), the kernel on one thread, and SDPA (the kernel unavailable:
    `kernels.paged_attention.load` gives None)."""

    def __init__(self) -> None:
        from tpkit.decode import paged_kv
        from tpkit.kernels import paged_attention as pa

        self.pa, self.kv, self.load, self.plan = pa, paged_kv, pa.load, paged_kv.decode_plan

    def on(self, mode: str = "kernel") -> None:
        self.pa.load = (lambda: None) if mode == "sdpa" else self.load
        self.kv.decode_plan = (functools.partial(self.plan, threads=1) if mode == ONE
                               else self.plan)


ONE = "kernel, 1 thread"
MODES = ("kernel", ONE, "sdpa")


def step_case(model, dtype, b: int, keys: int, reps: int, kernel: Kernel) -> dict:
    """Part 1: the decode step of `b` sequences at about `keys` keys each, in each mode.
    keys 40: the sequences' 40-token prompts prefilled first; more: random keys and values
    stand for the prompts (the time does not depend on the values; written, so that they
    are read from memory, not from the zero page of untouched pages)."""
    from tpkit.decode.paged_kv import NONE, PagedCache, Piece, forward

    nb = (keys + 80) // 16 + 1
    cache = PagedCache(model, 16, dtype)
    cache.grow(1 + nb * b)
    tables = [[1 + nb * i + j for j in range(nb)] for i in range(b)]
    if keys != 40:
        for t in (*cache.k, *cache.v):
            t.normal_()
    else:
        forward(model, cache, [Piece([(11 * i + j) % 1000 + 5 for j in range(40)], 0, t, NONE)
                               for i, t in enumerate(tables)])
    k = dict.fromkeys(MODES, 0)  # a position counter per contender

    def step(mode: str) -> None:
        kernel.on(mode)
        k[mode] = (k[mode] + 1) % 80
        forward(model, cache, [Piece([7], keys + k[mode], t) for t in tables], greedy=True)
        kernel.on()
    times = round_robin([Contender(m, functools.partial(step, m)) for m in MODES], reps,
                        warmup=3)
    span = "41-120" if keys == 40 else f"{keys + 1}-{keys + 80}"
    return _row(f"decode step, {b} seq x {span} keys", times)


def attention_case(attn, dtype, b: int, L: int, budget: float, kernel: Kernel) -> dict:
    """Part 2: one layer's `attend_paged` at `b` sequences of `L` keys, kernel (threads
    as torch's, and 1) vs SDPA."""
    from tpkit.decode.attend import attend_paged
    from tpkit.decode.paged_kv import PagedKV, Piece, layout

    nq, nkv, hd = attn.local_heads, attn.local_kv, attn.head_dim
    nb = -(-L // 16)
    blocks = 1 + b * nb
    g = torch.Generator().manual_seed(L)
    perm = (torch.randperm(blocks - 1, generator=g) + 1).tolist()  # scattered blocks
    k, v = (torch.randn(blocks * 16, nkv, hd, generator=g).to(dtype) for _ in range(2))
    pieces = [Piece([7], L - 1, perm[i * nb:(i + 1) * nb]) for i in range(b)]
    heads = torch.randn(b, nq + 2 * nkv, hd, generator=g).to(dtype)  # a row's q, k, v
    batches = {}
    for mode in MODES:
        kernel.on(mode)
        batches[mode] = layout(pieces, 16, attn.sliding_window, 8192, "cpu")[1]
        kernel.on()

    def call(name):
        return lambda: attend_paged(attn, heads, PagedKV(k, v, batches[name]))
    t0 = time.perf_counter()
    call("sdpa")()
    reps = reps_for(3 * (time.perf_counter() - t0), budget, lo=7, hi=200)
    times = round_robin([Contender(n, call(n)) for n in batches], reps, warmup=2)
    return _row(f"one layer's attention, {b} seq x {L} keys", times)


def _row(case: str, times: dict[str, list[float]]) -> dict:
    med = {n: 1000 * statistics.median(t) for n, t in times.items()}
    return dict(case=case, ms=med, rounds=len(times["sdpa"]),
                speedup=med["sdpa"] / med["kernel"])


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--folder", type=Path, default=None,
                   help="a SmolLM2-135M Hugging Face folder (default: random weights)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--long", action=argparse.BooleanOptionalAction, default=True,
                   help="also the steps at 1 x 4096 and 8 x 2048 keys (default: yes)")
    args = p.parse_args()
    from tpkit.kernels import paged_attention as pa
    from tpkit.weights.sources import load_model

    if pa.load() is None:
        raise SystemExit(f"the kernel is unavailable ({pa.LIBRARY.unavailable_reason()})")
    dtype = getattr(torch, args.dtype)
    kernel = Kernel()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or smollm2_shaped(Path(tmp) / "smollm2-shaped")
        model = load_model(str(folder), tp=1, dtype=dtype, decode=True)
    load = os.getloadavg()
    with torch.no_grad():
        steps = [(1, 40), (8, 40)] + ([(1, 4096), (8, 2048)] if args.long else [])
        rows = [step_case(model, dtype, b, keys, 10 if args.quick else 40, kernel)
                for b, keys in steps]
        shapes = [(8, 4096)] if args.quick else [(1, 45), (8, 45), (1, 4096), (8, 4096)]
        rows += [attention_case(model.layers["0"].attn, dtype, b, L,
                                args.budget or (2.0 if args.quick else 10.0), kernel)
                 for b, L in shapes]
    load = (load, os.getloadavg())
    print_table(f"paged decode attention, SmolLM2-135M shapes, {args.dtype}, torch threads "
                f"{torch.get_num_threads()}; load average {load[0][0]:.2f} before, "
                f"{load[1][0]:.2f} after (ms, medians of alternating rounds)",
                ["case", "SDPA loop", f"kernel ({pa.kernel_threads()} threads)", ONE,
                 "SDPA / kernel", "rounds"],
                [[r["case"], f"{r['ms']['sdpa']:.3f}", f"{r['ms']['kernel']:.3f}",
                  f"{r['ms'][ONE]:.3f}",
                  f"{r['speedup']:.2f}x", str(r["rounds"])] for r in rows])
    path = write_json("paged_attention", dict(
        environment=environment(), load_average=load, dtype=args.dtype,
        folder=str(args.folder), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), rows=rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
