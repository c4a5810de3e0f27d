"""Decode tokens/s through the CLI a user types, `tpkit generate`, variants alternating:
tp=1 with torch's default threads, tp=1 with one thread, tp=2, each dtype, on one or more
model folders. Each figure is the tokens/s that `tpkit generate` prints (generation only,
after loading), from a fresh process per run; the table gives the median of the rounds,
and the median of each round's ratio to the first run (the host's speed drifts by 10-20%
over minutes here: runs of one round are seconds apart, so their ratio is the steadier).

    .venv/bin/python benchmarks/decode_cli.py --make gpt2                  # GPT-2 124M, random
    .venv/bin/python benchmarks/decode_cli.py --folder smollm2=SMOLLM2 \\
        --runs tp=1,tp=2 --dtypes float32,bfloat16
    .venv/bin/python benchmarks/decode_cli.py --make heads9,heads8 --runs tp=1,tp=2

`--make` writes random folders (tests/hf_folders.py) into a temporary folder: `gpt2` is
GPT-2 124M; `heads9` is SmolLM2-135M's shape (30 layers, hidden 576, ffn 1536, 9 heads of
64, 3 kv heads; tp=2 splits 5 + 4 heads, the middle kv head held by both ranks); `heads8`
the same with 8 heads and 4 kv heads (tp=2: 4 + 4 heads, 2 kv heads per rank, as each
rank of heads9 holds), so that heads9 / heads8 at tp=2 is the uneven layout's cost.
A run `tp=N:omp1` sets OMP_NUM_THREADS=1; `tp=N:base` runs the code of `--base DIR` (another
checkout of tpkit, e.g. `git worktree add /tmp/base COMMIT`) instead of this one, so that
a change is measured against the code before it in the same rounds; `tp=N:NAME=VALUE` sets
an environment variable for that run (e.g. `tp=1:OMP_WAIT_POLICY=PASSIVE`). `--busy` keeps
one other process spinning on the machine for the whole benchmark (a busy neighbour).
`--bandwidth` also measures, each round, how fast one thread and two read memory (a sum
over 512 MB): a one-row decode streams its weights, so their ratio bounds what tp=2 (a
thread a rank) can gain over one thread here. Greedy, --ignore-eos, `--new` tokens after a
16-token prompt, at each `--batches` size. Rounds alternate: every variant once per round,
the order rotating. The load average is printed before and after each round.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = dict(
    heads9=dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, head_dim=64,
                num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True),
)
SHAPES["heads8"] = {**SHAPES["heads9"], "num_attention_heads": 8, "num_key_value_heads": 4}


def make(name: str, root: Path) -> Path:
    """A random folder: GPT-2 124M (transformers' init) or a SHAPES Llama."""
    import torch
    import transformers

    folder = root / name
    if name == "gpt2":
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(str(folder))
        return folder
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_folders import tiny_llama_folder

    return tiny_llama_folder(folder, **SHAPES[name])


def prompts(batch: int) -> list[str]:
    """`batch` prompts of 16 token ids below 300 (every folder's vocabulary has them)."""
    return [",".join(str(3 + (7 * i + 13 * b) % 290) for i in range(16)) for b in range(batch)]


def tokens_s(folder: Path, run: str, dtype: str, batch: int, new: int,
             base: Path | None = None) -> float:
    """The tokens/s one `tpkit generate` process prints."""
    tp, *flags = run.split(":")
    cmd = [sys.executable, "-m", "tpkit", "generate", "--checkpoint", str(folder),
           "--tp", tp.split("=")[1], "--dtype", dtype, "--max-new-tokens", str(new),
           "--ignore-eos", "--temperature", "0", *[f"--prompt-ids={p}" for p in prompts(batch)]]
    if "base" in flags and base is None:
        raise SystemExit(f"run {run}: give --base DIR (the checkout to compare with)")
    src = (base if "base" in flags else ROOT) / "src"
    env = {**os.environ, "PYTHONPATH": str(src)}
    if "omp1" in flags:
        env["OMP_NUM_THREADS"] = "1"
    env.update(f.split("=", 1) for f in flags if "=" in f)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    found = re.search(r"([\d.]+) tokens/s", done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd[3:9])}: {done.stderr.strip()[-500:]}")
    return float(found.group(1))


def load() -> str:
    """The 1, 5 and 15-minute load averages."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    """CLI: folders x runs x dtypes x batches, alternating rounds, a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--make", default="", help="random folders: gpt2, heads9, heads8")
    ap.add_argument("--runs", default="tp=1,tp=2,tp=1:omp1")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--base", type=Path, default=None,
                    help="another checkout, for runs tp=N:base (the code before a change)")
    ap.add_argument("--busy", action="store_true", help="a busy process beside every run")
    ap.add_argument("--bandwidth", action="store_true",
                    help="measure one thread's and two threads' memory reads each round")
    args = ap.parse_args()
    busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if args.busy else None
    try:
        run_all(args)
    finally:
        if busy is not None:
            busy.kill()


def read_gbs(threads: int, mb: int = 512) -> float:
    """GB/s of a sum over `mb` MB of float32 on `threads` of torch's threads (the best of
    5): how fast that many threads stream memory."""
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(mb << 18)
    try:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return x.numel() * 4 / best / 1e9


def run_all(args: argparse.Namespace) -> None:
    """The rounds and the table."""
    tmp = tempfile.TemporaryDirectory()
    folders = dict(f.split("=", 1) for f in args.folder)
    folders.update({m: make(m, Path(tmp.name)) for m in args.make.split(",") if m})
    variants = [(f, r, d, int(b)) for f in folders for b in args.batches.split(",")
                for d in args.dtypes.split(",") for r in args.runs.split(",")]
    got: dict[tuple, dict[int, float]] = {v: {} for v in variants}  # round -> tokens/s
    print(f"load before: {load()}", flush=True)
    reads: dict[int, list[float]] = {1: [], 2: []}
    for k in range(args.rounds):
        if args.bandwidth:
            for t in reads:
                reads[t].append(read_gbs(t))
            print(f"round {k + 1}: reads memory at {reads[1][-1]:.1f} GB/s on one thread, "
                  f"{reads[2][-1]:.1f} on two", flush=True)
        for i in range(len(variants)):
            v = variants[(k + i) % len(variants)]
            try:
                got[v][k] = tokens_s(Path(folders[v[0]]), v[1], v[2], v[3], args.new,
                                     args.base)
                print(f"round {k + 1}: {v[0]} batch {v[3]} {v[2]} {v[1]}: "
                      f"{got[v][k]:.1f} tokens/s", flush=True)
            except RuntimeError as e:  # e.g. a loaded machine past generate's time limit
                print(f"round {k + 1}: {' '.join(map(str, v))} failed: {e}", flush=True)
        print(f"round {k + 1}: load {load()}", flush=True)
    print(f"\nmedians of {args.rounds} rounds, `tpkit generate` tokens/s, {args.new} new tokens\n")
    print("| model | batch | dtype | run | tokens/s | vs the first run | the rounds' ratios' "
          "median | runs |")
    print("|---|---:|---|---|---:|---:|---:|---|")
    for v in variants:
        first = next(w for w in variants if w[0] == v[0] and w[2:] == v[2:])
        if not got[v] or not got[first]:
            print(f"| {v[0]} | {v[3]} | {v[2]} | {v[1]} | - | - | - | every run failed |")
            continue
        med, base = statistics.median(got[v].values()), statistics.median(got[first].values())
        paired = [x / got[first][k] for k, x in got[v].items() if k in got[first]]
        pair = f"{statistics.median(paired):.2f}x" if paired else "-"
        print(f"| {v[0]} | {v[3]} | {v[2]} | {v[1]} | {med:.1f} | {med / base:.2f}x | {pair} | "
              + " ".join(f"{x:.1f}" for x in got[v].values()) + " |")
    if args.bandwidth:
        one, two = statistics.median(reads[1]), statistics.median(reads[2])
        print(f"\nmemory read (medians): one thread {one:.1f} GB/s, two {two:.1f} "
              f"({two / one:.2f}x)")
    print(f"\nload after: {load()}")


if __name__ == "__main__":
    main()
