"""`tpkit serve` under load: N concurrent clients (1, 4, 16, 32) streaming completions of
mixed prompt lengths from a GPT-2 124M-class model (random weights, a Hugging Face
folder; or SmolLM2-135M's shapes, 9 heads, for tp=3), against transformers' own batched `generate` on the same folder, in one run.

    PYTHONPATH=src python benchmarks/serve_load.py [--tp 1,2] [--clients 1,4,16,32]
        [--max-tokens 16] [--model gpt2|smollm2] [--decode-chunk rows[,8,1]]
        [--dtype float32|bfloat16]
        [--prefill-per-step 256[,0]]
        [--out bench-results/serve_load.json]

Each client sends its requests one after the other (closed loop), two per client (four
at least) per concurrency level; every request asks for exactly `--max-tokens` tokens
(`ignore_eos`). Measured at the client: output tokens/s over the level's wall time,
time to first token (TTFT) and inter-token latency (ITL, the gaps between streamed
tokens), p50 and p99. transformers: the same prompts in batches of N (left-padded,
greedy, exactly max-tokens new tokens); its TTFT is a batch's prefill (`generate` with
one new token), its ITL the rest divided by max-tokens - 1. Every process computes
with one torch thread (tpkit tp=1 and transformers: one core; tp=2: one per rank).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (8, 16, 32, 64, 128)  # prompt tokens, mixed
THREADS = 1  # torch threads per process: on a shared, loaded machine, 2 threads per
# process are many times slower than 1 (every small op waits for a descheduled thread)


SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=2048, rope_theta=100000.0,
                    tie_word_embeddings=True)  # SmolLM2-135M's shapes: 9 heads, 3 kv heads


def make_folder(out: Path, kind: str) -> Path:
    """A random GPT-2 124M or SmolLM2-135M-shaped Llama (transformers' own init, seed 0),
    saved as a HF folder."""
    import torch
    import transformers

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()) if kind == "gpt2" else \
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_135M))
    model.save_pretrained(str(out))
    return out


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.choice(LENGTHS))] for _ in range(n)]


def per_level(clients: int) -> int:
    """Requests sent at a concurrency level: two per client, at least four."""
    return max(4, 2 * clients)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def one_request(port: int, ids: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT, ITL gaps, tokens) of one streamed completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": "gpt2", "prompt": ids, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    times = []
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
            times.append(time.perf_counter())
    conn.close()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return times[0] - t0, gaps, len(times)


def load_level(port: int, clients: int, work: list[list[int]], max_tokens: int) -> dict:
    """`clients` threads share `work` (closed loop); the level's figures."""
    todo, lock, results = list(work), threading.Lock(), []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                ids = todo.pop()
            results.append(one_request(port, ids, max_tokens))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r[0] for r in results]
    itl = [g for r in results for g in r[1]]
    return dict(tokens_s=sum(r[2] for r in results) / wall, ttft_p50=pct(ttft, .5),
                ttft_p99=pct(ttft, .99), itl_p50=pct(itl, .5), itl_p99=pct(itl, .99))


def serve_levels(folder: Path, tp: int, levels: list[int], work, max_tokens: int,
                 chunk: int | None, prefill: int | None, dtype: str = "float32") -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpkit", "serve", "--checkpoint", str(folder), "--tp", str(tp),
         "--port", "0", "--max-batch", str(max(levels)), "--max-len",
         str(max(LENGTHS) + max_tokens), "--dtype", dtype,
         *(["--batch-invariant", "--decode-chunk", str(chunk)] if chunk else []),
         *(["--prefill-per-step", str(prefill)] if prefill is not None else []),
         "--served-model-name", "gpt2"],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(THREADS)})
    try:
        line = proc.stdout.readline()
        port = int(line.split()[2].rsplit(":", 1)[1].split("/")[0])
        one_request(port, work[0], 2)  # warm-up
        return {n: load_level(port, n, work[:per_level(n)], max_tokens) for n in levels}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def transformers_levels(folder: Path, levels: list[int], work, max_tokens: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(THREADS)  # as each tpkit rank
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    out = {}
    for n in levels:
        level = work[:per_level(n)]
        batches = [level[i:i + n] for i in range(0, len(level), n)]
        tokens, wall, ttft, itl = 0, 0.0, [], []
        for batch in batches:
            s = max(map(len, batch))
            ids = torch.tensor([[0] * (s - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (s - len(p)) + [1] * len(p) for p in batch])
            kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
            with torch.no_grad():
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=1, **kw)
                t1 = time.perf_counter()
                model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
                t2 = time.perf_counter()
            tokens, wall = tokens + len(batch) * max_tokens, wall + (t2 - t1)
            ttft += [t1 - t0] * len(batch)
            itl.append((t2 - t1 - (t1 - t0)) / (max_tokens - 1))
        out[n] = dict(tokens_s=tokens / wall, ttft_p50=pct(ttft, .5), ttft_p99=pct(ttft, .99),
                      itl_p50=pct(itl, .5), itl_p99=pct(itl, .99))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="1,2", help="tpkit tp sizes (default 1,2)")
    ap.add_argument("--clients", default="1,4,16,32", help="concurrency levels")
    ap.add_argument("--max-tokens", type=int, default=16, help="new tokens per request")
    ap.add_argument("--decode-chunk", default="rows", help="rows (tpkit serve's default: the "
                    "running rows) or C (--batch-invariant --decode-chunk C); e.g. rows,8,1")
    ap.add_argument("--dtype", default="float32", help="tpkit serve --dtype")
    ap.add_argument("--prefill-per-step", default=None, help="tpkit serve --prefill-per-step "
                    "values (default: the server's; e.g. 256,0)")
    ap.add_argument("--model", choices=["gpt2", "smollm2"], default="gpt2",
                    help="GPT-2 124M, or SmolLM2-135M's shapes (9 heads: tp=3 works)")
    ap.add_argument("--folder", default=None, help="HF folder (default: a temporary one)")
    ap.add_argument("--out", default="bench-results/serve_load.json", help="JSON results")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    work = prompts(per_level(max(levels)), 50257 if args.model == "gpt2" else 49152)
    tmp = tempfile.TemporaryDirectory()
    folder = make_folder(Path(args.folder or tmp.name) / f"{args.model}-random", args.model)
    load0 = open("/proc/loadavg").read().split()[:3]
    chunks = [None if c == "rows" else int(c) for c in args.decode_chunk.split(",")]
    prefills = [int(x) for x in args.prefill_per_step.split(",")] if args.prefill_per_step \
        else [None]
    rows = {f"tpkit tp={tp}" + (f" chunk={c or 'rows'}" if len(chunks) > 1 else "")
            + (f" prefill={f}" if len(prefills) > 1 else ""):
            serve_levels(folder, int(tp), levels, work, args.max_tokens, c, f, args.dtype)
            for tp in args.tp.split(",") for c in chunks for f in prefills}
    rows["transformers generate (batched)"] = transformers_levels(folder, levels, work,
                                                                 args.max_tokens)
    load1 = open("/proc/loadavg").read().split()[:3]
    print(f"load average before {' '.join(load0)}, after {' '.join(load1)}; "
          f"{os.cpu_count()} CPUs; 2 requests per client (4 at least) x {args.max_tokens} tokens, "
          f"prompts of {LENGTHS} tokens")
    print("| server | clients | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, per in rows.items():
        for n, r in per.items():
            print(f"| {name} | {n} | {r['tokens_s']:.1f} | {r['ttft_p50']:.2f} / "
                  f"{r['ttft_p99']:.2f} | {r['itl_p50']:.3f} / {r['itl_p99']:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(load=[load0, load1], rows=rows), indent=1))


if __name__ == "__main__":
    main()
