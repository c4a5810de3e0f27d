"""Decoding speed: `tpkit generate` at tp=1 and tp=2 (shared memory; gloo with --gloo)
against transformers' own `generate`, on random-weight models saved as Hugging Face folders.

    gpt2-124m     GPT-2 small (12 layers, 12 heads, h=768): tp 1, 2
    smollm2-135m  SmolLM2-135M's shape (30 layers, 9 heads, 3 kv heads, h=576): tp 1, 2
                  (uneven: 5 + 4 heads)

Greedy, --ignore-eos, 48 new tokens after a 16-token prompt, batch 1 and 8. Each tpkit
figure is the tokens/s `tpkit generate` prints (generation only, after loading), from a
fresh process per run; transformers runs in this process on the same folder (its
default threads: every core, like tpkit at tp=1; at tp=n each rank has 1 thread).
`tp=1 1 thread` is tp=1 under OMP_NUM_THREADS=1 (the issue's second yardstick).
The contenders run in turn, `--runs` rounds (the order rotating each round); each
figure is the median of its rounds, each ratio the median of the per-round ratios.
`--busy`: one other busy process (`python -c 'while 1: pass'`) runs throughout.
`--quantize int8` / `--dtype bfloat16` pass through to every tpkit run.

    .venv/bin/python benchmarks/decode.py [--quick] [--runs 5] [--busy] [--gloo]

Writes bench-results/decode.json (decode_busy.json with --busy).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import environment, parser, print_table, write_json

NEW, PROMPT = 48, 16
SRC = str(Path(__file__).resolve().parents[1] / "src")
# the targets: tp=2 >= tp=1 (its default threads), >= 1.6x tp=1 on one thread,
# >= 0.9x tp=1 with one busy process on the machine
TARGETS = dict(tp2_vs_tp1=1.0, tp2_vs_tp1_1thread=1.6, tp2_vs_tp1_busy=0.9)


def save_models(root: Path, quick: bool) -> dict[str, tuple[Path, list[int]]]:
    """Random-weight Hugging Face folders: name -> (folder, tp sizes to run)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = {}
    gpt2 = GPT2LMHeadModel(GPT2Config())
    gpt2.save_pretrained(root / "gpt2-124m")
    out["gpt2-124m"] = (root / "gpt2-124m", [1, 2])
    if not quick:
        smol = LlamaForCausalLM(LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True))
        smol.save_pretrained(root / "smollm2-135m")
        out["smollm2-135m"] = (root / "smollm2-135m", [1, 2])  # 9 heads: 5 + 4
    return out


def prompts(batch: int) -> list[list[int]]:
    """`batch` prompts of PROMPT token ids (the same on every contender)."""
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, 5000, (batch, PROMPT), generator=g).tolist()


def tpkit_tokens_s(folder: Path, tp: int, batch: int, comm: str, extra: list[str],
                   threads: int | None = None) -> float:
    """Tokens/s that `tpkit generate` reports (a fresh process)."""
    ids = [f"--prompt-ids={','.join(map(str, p))}" for p in prompts(batch)]
    cmd = [sys.executable, "-m", "tpkit", "generate", "--checkpoint", str(folder), "--tp",
           str(tp), "--max-new-tokens", str(NEW), "--ignore-eos", "--comm", comm, *extra, *ids]
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    found = re.search(r"([\d.]+) tokens/s", done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd[:8])}...: {done.stderr.strip()[-500:]}")
    return float(found.group(1))


def transformers_tokens_s(folder: Path, batch: int) -> float:
    """Tokens/s of transformers' greedy generate on the same folder and prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = torch.tensor(prompts(batch))
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        seconds = time.perf_counter() - t0
    return (out.shape[1] - PROMPT) * batch / seconds


def contenders(tps: list[int], gloo: bool, hf: bool) -> list[tuple[str, int, str, int | None]]:
    """(name, tp, comm, threads) of every contender; tp 0 is transformers."""
    out = [("transformers", 0, "", None)] if hf else []
    for tp in tps:
        if tp == 1:
            out += [("tpkit tp=1", 1, "auto", None), ("tpkit tp=1 1 thread", 1, "auto", 1)]
        else:
            out.append((f"tpkit tp={tp} shm", tp, "shm", None))
            if gloo:
                out.append((f"tpkit tp={tp} gloo", tp, "gloo", None))
    return out


def run(args) -> list[dict]:
    rows, extra = [], []
    if args.quantize:
        extra += ["--quantize", args.quantize]
    if args.dtype:
        extra += ["--dtype", args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (folder, tps) in save_models(Path(tmp), args.quick).items():
            for batch in map(int, args.batch.split(",")):
                runners = contenders(tps, args.gloo, not args.no_transformers)
                seen: dict[str, list[float]] = {c[0]: [] for c in runners}
                for r in range(args.runs):
                    for i in range(len(runners)):  # the order rotates round by round
                        who, tp, comm, threads = runners[(r + i) % len(runners)]
                        seen[who].append(transformers_tokens_s(folder, batch) if tp == 0 else
                                         tpkit_tokens_s(folder, tp, batch, comm, extra, threads))
                row = dict(model=name, batch=batch, runs=seen,
                           tokens_s={k: statistics.median(v) for k, v in seen.items()})
                print(name, batch, {k: [round(x, 1) for x in v] for k, v in seen.items()},
                      open("/proc/loadavg").read().split()[:3], flush=True)
                rows.append(row)
    return rows


def _ratio(runs: dict[str, list[float]], a: str, b: str) -> float:
    """Median of the per-round ratios a / b (the rounds pair them)."""
    return statistics.median(x / y for x, y in zip(runs[a], runs[b]))


def report(rows: list[dict], busy: bool) -> dict:
    """The table and the issue's targets for tp=2 against tp=1."""
    table, worst = [], {}
    for r in rows:
        t, runs = r["tokens_s"], r["runs"]
        tp_n = next(k for k in t if k.endswith(" shm"))
        ratios = {"tp2_vs_tp1_busy" if busy else "tp2_vs_tp1": _ratio(runs, tp_n, "tpkit tp=1"),
                  "tp2_vs_tp1_1thread": _ratio(runs, tp_n, "tpkit tp=1 1 thread")}
        if busy:
            ratios.pop("tp2_vs_tp1_1thread")
        for k, v in ratios.items():
            worst[k] = min(worst.get(k, v), v) if r["model"] == "gpt2-124m" else worst.get(k, v)
        table.append([r["model"], str(r["batch"]), *(f"{v:.1f}" for v in t.values()),
                      *(f"{v:.2f}x" for v in ratios.values())])
        cols = list(t) + [f"{k} (median ratio)" for k in ratios]
    print_table(f"decode tokens/s, medians of the rounds (greedy, {NEW} new tokens, prompt "
                f"{PROMPT}{', one busy process' if busy else ''})", ["model", "batch", *cols],
                table)
    verdict = {k: dict(target=TARGETS[k], worst_gpt2=v, met=v >= TARGETS[k])
               for k, v in worst.items()}
    for name, v in verdict.items():
        print(f"  {name}: target {v['target']}, worst (gpt2-124m) {v['worst_gpt2']:.2f}, "
              f"met: {v['met']}")
    return verdict


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="alternating rounds (medians)")
    p.add_argument("--batch", default="1,8", help="batch sizes")
    p.add_argument("--busy", action="store_true", help="one other busy process throughout")
    p.add_argument("--gloo", action="store_true", help="also tp=2 over gloo")
    p.add_argument("--no-transformers", action="store_true", help="tpkit's contenders only")
    p.add_argument("--quantize", default=None, help="passed to every tpkit run")
    p.add_argument("--dtype", default=None, help="passed to every tpkit run")
    args = p.parse_args()
    load = Path("/proc/loadavg").read_text().split()[:3]
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if args.busy else None
    try:
        rows = run(args)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    verdict = report(rows, args.busy)
    path = write_json("decode_busy" if args.busy else "decode", dict(
        environment=environment(), args=vars(args), load_before=load,
        load_after=Path("/proc/loadavg").read_text().split()[:3], rows=rows, verdict=verdict))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
