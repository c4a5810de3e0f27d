"""`tpkit serve`'s paged KV cache under load, on SmolLM2-135M's shapes (random weights,
a Hugging Face folder), through the real CLI and the HTTP API, in one run:

1. prefix cache: 16 clients at once, each one request of a shared 512-token system
   prompt + its own 16-48 tokens (greedy, 16 new tokens): time to first token p50/p99
   and the prompt tokens the server computed (its /metrics), prefix cache on against
   `--no-prefix-cache`, at each `--prefix-prefill-per-step` budget (256, the server's
   default: the first request's pieces fill the steps while the others wait; 0: no
   limit); `--busy-prompt N`: the clients arrive while the server computes an unrelated
   N-token prompt, so they are queued in one step (all admitted at once unless the
   others wait for the first one's blocks: `serve.scheduler`);
2. a long prompt arriving under load: 8 clients streaming 64 tokens each, and after
   a second one more client sends a `--long`-token prompt: the gaps between the 8
   streams' tokens (ITL) p50 and p99, at each `--prefill-per-step` budget (256, the
   server's default; 32; 0: no limit, the whole prompt in one step, as a prefill ran
   before), fixed (`--itl-ratio 0`; benchmarks/serve_itl.py measures the paced budget):
   the long prompt is computed in pieces of the budget between the decodes.

    PYTHONPATH=src python benchmarks/serve_prefix.py [--long 4096] [--rounds 1]
        [--prefill-per-step 256,32,0] [--prefix-prefill-per-step 256] [--busy-prompt 0]
        [--no-prefix]
        [--no-long] [--folder HF_DIR] [--out bench-results/serve_prefix.json]

Each server runs with one torch thread (`OMP_NUM_THREADS=1`); a warm-up request that
shares nothing comes first. `--rounds` alternates the contenders and reports medians.
Prints markdown tables and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import ROOT, SMOLLM2_135M, one_request, pct  # noqa: E402

SYSTEM, CLIENTS, DECODERS = 512, 16, 8


def make_folder(out: Path, positions: int) -> Path:
    """SmolLM2-135M's shapes, random (transformers' init, seed 0), `positions` long."""
    import torch
    import transformers

    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**{**SMOLLM2_135M, "max_position_embeddings": positions})
        transformers.LlamaForCausalLM(cfg).save_pretrained(str(out))
    return out


def start(folder: Path, flags: list[str], max_len: int) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpkit", "serve", "--checkpoint", str(folder), "--port", "0",
         "--max-batch", "16", "--max-len", str(max_len), "--served-model-name", "gpt2",
         *flags], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"})
    port = int(proc.stdout.readline().split()[2].rsplit(":", 1)[1].split("/")[0])
    one_request(port, [7, 8, 9], 2)  # warm-up, sharing nothing
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def computed(port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    return int(re.search(rb"^tpkit_prompt_tokens_computed_total (\d+)", text, re.M)[1])


def together(port: int, work: list[tuple[list[int], int]], delays=None) -> list:
    """Each (prompt, max_tokens) from its own thread at once (or after its delay)."""
    out: list = [None] * len(work)

    def run(i):
        time.sleep((delays or [0] * len(work))[i])
        out[i] = one_request(port, *work[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def prefix_round(folder: Path, cache: bool, vocab: int, prefill: int, busy: int) -> dict:
    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(SYSTEM)]
    work = [(system + [rng.randrange(vocab) for _ in range(rng.randrange(16, 49))], 16)
            for _ in range(CLIENTS)]
    blocker = [([rng.randrange(vocab) for _ in range(busy)], 1)] if busy else []
    flags = ["--prefill-per-step", str(prefill)] + ([] if cache else ["--no-prefix-cache"])
    proc, port = start(folder, flags, 1024)
    try:
        before = computed(port)  # the clients 0.3 s after the busy prompt (its step runs)
        res = together(port, blocker + work, [0.0] * len(blocker) + [0.3 * bool(busy)] * CLIENTS)
        ttft = [r[0] for r in res[len(blocker):]]
        return dict(ttft_p50=pct(ttft, .5), ttft_p99=pct(ttft, .99),
                    computed=computed(port) - before - busy, prompt=sum(len(p) for p, _ in work))
    finally:
        stop(proc)


def long_round(folder: Path, prefill: int, long: int, vocab: int) -> dict:
    rng = random.Random(1)
    work = [([rng.randrange(vocab) for _ in range(32)], 64) for _ in range(DECODERS)]
    work.append(([rng.randrange(vocab) for _ in range(long)], 4))
    proc, port = start(folder, ["--prefill-per-step", str(prefill), "--itl-ratio", "0"],
                       long + 128)  # fixed budgets (benchmarks/serve_itl.py: the paced one)
    try:
        res = together(port, work, [0] * DECODERS + [1.0])
        itl = [g for r in res[:DECODERS] for g in r[1]]
        return dict(itl_p50=pct(itl, .5), itl_p99=pct(itl, .99), long_ttft=res[-1][0])
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--long", type=int, default=4096, help="tokens of the long prompt")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds (medians)")
    ap.add_argument("--prefill-per-step", default="256,32,0",
                    help="the long-prompt round's contenders (0: no limit)")
    ap.add_argument("--prefix-prefill-per-step", default="256",
                    help="the prefix-cache round's --prefill-per-step budgets (0: no limit)")
    ap.add_argument("--busy-prompt", type=int, default=0, metavar="N",
                    help="the prefix round: a prompt of N unrelated tokens sent 0.3 s before "
                    "the clients, so they arrive while its prefill runs (in one step)")
    ap.add_argument("--no-prefix", action="store_true", help="skip the prefix-cache round")
    ap.add_argument("--no-long", action="store_true", help="skip the long-prompt round")
    ap.add_argument("--folder", default=None, help="HF folder (default: a temporary one)")
    ap.add_argument("--out", default="bench-results/serve_prefix.json", help="JSON results")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    positions = 1 << max(11, (args.long + 128 - 1).bit_length())
    folder = make_folder(Path(args.folder or tmp.name) / f"smollm2-random-{positions}",
                         positions)
    vocab = SMOLLM2_135M["vocab_size"]
    budgets = [] if args.no_long else [int(x) for x in args.prefill_per_step.split(",")]
    contenders = [] if args.no_prefix else [
        (cache, int(b)) for b in args.prefix_prefill_per_step.split(",") for cache in (True, False)]
    loads, long = [os.getloadavg()[0]], {b: [] for b in budgets}
    prefix: dict = {c: [] for c in contenders}
    for _ in range(args.rounds):
        for cache, prefill in contenders:
            prefix[cache, prefill].append(prefix_round(folder, cache, vocab, prefill,
                                                       args.busy_prompt))
        for prefill in budgets:
            long[prefill].append(long_round(folder, prefill, args.long, vocab))
        loads.append(os.getloadavg()[0])
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    print(f"\nload average (1 min) {min(loads):.1f}-{max(loads):.1f}; "
          f"{args.rounds} round(s), medians\n")
    print("| --prefill-per-step | prefix cache | TTFT p50 (s) | TTFT p99 (s) | "
          "prompt tokens computed / sent |")
    print("|---|---|---:|---:|---:|")
    for (cache, prefill), r in prefix.items():
        print(f"| {prefill} | {'on' if cache else 'off'} | {med(r, 'ttft_p50'):.2f} | "
              f"{med(r, 'ttft_p99'):.2f} | {med(r, 'computed'):.0f} / {r[0]['prompt']} |")
    if budgets:
        print(f"\n| --prefill-per-step | ITL p50 (s) | ITL p99 (s) | p99 / p50 | "
              f"{args.long}-token prompt's TTFT (s) |")
        print("|---|---:|---:|---:|---:|")
        for prefill in budgets:
            r = long[prefill]
            p50, p99 = med(r, "itl_p50"), med(r, "itl_p99")
            print(f"| {prefill} | {p50:.3f} | {p99:.3f} | {p99 / p50:.1f} | "
                  f"{med(r, 'long_ttft'):.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(prefix={f"{'on' if c else 'off'},{b}": v
                                                      for (c, b), v in prefix.items()},
                                              long={str(k): v for k, v in long.items()},
                                              loads=loads), indent=1))


if __name__ == "__main__":
    main()
