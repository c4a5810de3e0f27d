"""`tpkit serve`'s inter-token latency while a long prompt arrives under load: the paced
prompt budget (`--itl-ratio R`) against the fixed one (`--itl-ratio 0`: pieces of
`--prefill-per-step` tokens), through the real CLI and the HTTP API, alternating in one
run.

8 clients stream completions (32-token prompts, greedy, ignore_eos); once every one has
streamed for `--settle` seconds, one more client sends a `--long`-token prompt (2 new
tokens). Measured at the clients: the gaps between the 8 streams' tokens (ITL) in the
`--settle` seconds before the long prompt arrives and after its first token (p50: the
decode-only level; the streams' contexts grow meanwhile, so both are shown) and while
it is computed (the gaps ending between its arrival and its first token: p50, p99),
and its time to first token (TTFT), and the pacer's gauges on /metrics at that moment
(its last budget, D and costs). Then the streams close (the server cancels them).
The figure of the target: p99 during the long prompt / p50 before it, and / p50 after
it (the decode-only level at the streams' longer contexts, where the long prompt's
last pieces ran).

    PYTHONPATH=src python benchmarks/serve_itl.py [--long 4096] [--rounds 5]
        [--itl-ratio 1.5,0] [--prefill-per-step 256] [--tp 1] [--folder HF_DIR]
        [--out bench-results/serve_itl.json]

Default model: SmolLM2-135M's shapes with random weights (transformers' init, seed 0),
8192 positions, made in a temporary folder; `--folder` takes a Hugging Face folder (the
real SmolLM2-135M-Instruct, for one). Each server process computes with one torch
thread (`OMP_NUM_THREADS=1`; `--tp 2`: two processes, 9 heads split 5 + 4). Prints a markdown table of medians and the load average.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import one_request, pct  # noqa: E402
from serve_prefix import make_folder, start, stop  # noqa: E402

DECODERS, SHORT = 8, 32


def stream(port: int, ids: list[int], max_tokens: int, times: list[float],
           done: threading.Event) -> None:
    """One streamed completion: each token's arrival time into `times`, until it ends or
    `done` is set (then the connection closes: the server cancels it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": "gpt2", "prompt": ids, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    for line in conn.getresponse():
        if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
            times.append(time.perf_counter())
        if done.is_set():
            break
    conn.close()


def one_run(port: int, long: int, vocab: int, settle: float) -> dict:
    """8 streams, then the long prompt; the gaps and the long prompt's TTFT."""
    rng = random.Random(1)
    shorts = [[rng.randrange(vocab) for _ in range(SHORT)] for _ in range(DECODERS)]
    long_ids = [rng.randrange(vocab) for _ in range(long)]
    times: list[list[float]] = [[] for _ in range(DECODERS)]
    done = threading.Event()
    threads = [threading.Thread(target=stream, args=(port, ids, long + 64, t, done))
               for ids, t in zip(shorts, times)]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < 2:
        time.sleep(0.05)
    settled = time.perf_counter()
    time.sleep(settle)
    arrive = time.perf_counter()
    ttft = one_request(port, long_ids, 2)[0]
    first = arrive + ttft
    pacing = pacer_state(port)
    ended = [len(t) for t in times]
    time.sleep(settle)
    last = time.perf_counter()
    done.set()
    for t in threads:
        t.join()
    gaps = [(a, b - a) for ts in times for a, b in zip(ts, ts[1:])]
    before = [g for a, g in gaps if settled <= a and a + g <= arrive]
    during = [g for a, g in gaps if arrive < a + g <= first]
    after = [g for a, g in gaps if first <= a and a + g <= last]
    return dict(itl_p50_before=pct(before, .5), itl_p99_before=pct(before, .99),
                itl_p50_after=pct(after, .5),
                itl_p50_during=pct(during, .5), itl_p99_during=pct(during, .99),
                gaps_during=len(during), long_ttft=ttft,
                streams_ended_early=sum(n >= long + 64 for n in ended), **pacing)


def pacer_state(port: int) -> dict:
    """The pacer's gauges on /metrics (its last budget, D, costs; none when it is off)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name.startswith("tpkit_pacing_") and s.name != "tpkit_pacing_itl_ratio":
                out[s.name.removeprefix("tpkit_pacing_") + "".join(
                    f"_{v}" for v in s.labels.values())] = s.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--long", type=int, default=4096, help="tokens of the long prompt")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians)")
    ap.add_argument("--itl-ratio", default="1.5,0",
                    help="the contenders' tpkit serve --itl-ratio (0: the fixed budget)")
    ap.add_argument("--prefill-per-step", type=int, default=256,
                    help="tpkit serve --prefill-per-step (every contender)")
    ap.add_argument("--tp", type=int, default=1, help="tpkit serve --tp (every contender)")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds the streams run before the long prompt arrives")
    ap.add_argument("--folder", default=None, help="HF folder (default: a random SmolLM2-"
                    "135M-shaped one with 8192 positions, made in a temporary folder)")
    ap.add_argument("--out", default="bench-results/serve_itl.json", help="JSON results")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    folder = Path(args.folder) if args.folder else \
        make_folder(Path(tmp.name) / "smollm2-random-8192", 8192)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ratios = args.itl_ratio.split(",")
    runs: dict[str, list[dict]] = {r: [] for r in ratios}
    loads = [os.getloadavg()]
    for i in range(args.rounds):
        for ratio in ratios:
            proc, port = start(folder, ["--itl-ratio", ratio, "--prefill-per-step",
                                        str(args.prefill_per_step), "--tp", str(args.tp)],
                               args.long + 128)
            try:
                runs[ratio].append(one_run(port, args.long, vocab, args.settle))
            finally:
                stop(proc)
            loads.append(os.getloadavg())
            r = runs[ratio][-1]
            print(f"round {i + 1} --itl-ratio {ratio}: ITL before p50 {r['itl_p50_before']:.3f}"
                  f" p99 {r['itl_p99_before']:.3f} s, after p50 {r['itl_p50_after']:.3f} s, "
                  f"during p50 {r['itl_p50_during']:.3f} p99 {r['itl_p99_during']:.3f} s, TTFT "
                  f"{r['long_ttft']:.1f} s; load {loads[-1][0]:.1f}", flush=True)
            if "decode_step_seconds" in r:  # at the long prompt's first token
                print(f"  pacer: budget {r['prompt_budget_tokens']:.0f} tokens, D "
                      f"{r['decode_step_seconds']:.4f} s, a {r['cost_seconds_token']:.2e} "
                      f"b {r['cost_seconds_token_kpos']:.2e} g {r['cost_seconds_kkeys']:.2e}"
                      f" s", flush=True)
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    one = [x[0] for x in loads]
    print(f"\nload average (1 min) {min(one):.1f}-{max(one):.1f} over the run; "
          f"{os.cpu_count()} CPUs; {args.rounds} alternating round(s), medians; "
          f"{DECODERS} streams, a {args.long}-token prompt; tp={args.tp}; {folder.name}\n")
    print("| --itl-ratio | ITL p50 / p99 before (s) | ITL p50 after (s) | ITL p50 during (s) "
          "| ITL p99 during (s) | p99 during / p50 before, after | long prompt's TTFT (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for ratio, rows in runs.items():
        name = f"{ratio} (fixed {args.prefill_per_step})" if float(ratio) == 0 else ratio
        ratios_ = [r["itl_p99_during"] / r["itl_p50_before"] for r in rows]
        after = statistics.median(r["itl_p99_during"] / r["itl_p50_after"] for r in rows)
        print(f"| {name} | {med(rows, 'itl_p50_before'):.3f} / {med(rows, 'itl_p99_before'):.3f}"
              f" | {med(rows, 'itl_p50_after'):.3f} | {med(rows, 'itl_p50_during'):.3f}"
              f" | {med(rows, 'itl_p99_during'):.3f} | {statistics.median(ratios_):.2f}, "
              f"{after:.2f} | "
              f"{med(rows, 'long_ttft'):.1f} |")
    early = sum(r["streams_ended_early"] for rows in runs.values() for r in rows)
    if early:
        print(f"\nwarning: {early} stream(s) ended before the long prompt's first token")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(runs=runs, loads=loads, long=args.long,
                                              tp=args.tp, folder=str(folder)), indent=1))


if __name__ == "__main__":
    main()
