"""N-gram speculative decoding against none, and against llama.cpp's, each server
started through its real CLI on the same weights (issue 49). Not part of `make test`.

    .venv/bin/python benchmarks/serve_speculative.py --hf SMOLLM2 \\
        [--llama-server LLAMA/build/bin/llama-server --gguf F32=f32.gguf --gguf BF16=bf16.gguf] \\
        [--rounds 5] [--clients 1,8] [--max-tokens 128] [--only tpkit] [--sets grounded]

Contenders: `tpkit serve` float32 and bfloat16, each without and with `--speculative
ngram` (and, `--draft PATH`, `--speculative draft --draft-checkpoint PATH`: a draft
model with SmolLM2's tokenizer, e.g. its first layers, benchmarks/smollm2_draft.py); llama-server (each GGUF given) without and with `--spec-type ngram-simple`
(`--llama-spec TYPE`, repeatable, adds others, e.g. ngram-map-k). Every server holds 8
sequences (tpkit `--max-batch 8 --max-len 2048`, llama-server `-np 8 -c 16384`).

Prompts (chat, greedy, `--max-tokens` new tokens): grounded ones, whose answer copies
from the prompt: a passage of ~400-700 tokens of this repository's docs followed by
"repeat it with X changed", "summarise", "extract every name", and a source file of
this repository followed by "rename this function"; ungrounded ones: open questions
(`serve_peers.PROMPTS`). Each level: 1 client (the first two prompts one after the
other) or 8 concurrent clients (8 prompts). Output tokens (the servers' `usage`) over
the wall time; medians over the rounds, the contenders alternated (the order rotates
from round to round); the load average before and after each contender. tpkit's
acceptance rate from its /metrics (`tpkit_spec_*`), llama.cpp's from its responses'
`timings` (draft_n, draft_n_accepted). Greedy texts are compared with the same dtype's
contender without speculation: where they differ the table says where.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_peers import PROMPTS as OPEN  # noqa: E402
from serve_peers import (  # noqa: E402  (the peers script's server handling, reused)
    TPKIT,
    Contender,
    closed_loop,
    first_difference,
    loadavg,
    start,
    stop,
)

ROOT = Path(__file__).resolve().parents[1]


def _passage(doc: str, heading: str, words: int) -> str:
    """About `words` words of the repository's `doc` from the section `heading` on."""
    text = (ROOT / doc).read_text().split(heading, 1)[1]
    text = re.sub(r"```.*?```|\|.*\n", "", text, flags=re.S)  # no code, no tables
    return " ".join(text.split()[:words])


def _code(path: str, name: str) -> str:
    """The function `name` of the repository's source file `path` (its def to the next)."""
    src = (ROOT / path).read_text()
    body = src.split(f"    def {name}(", 1)[1].split("\n    def ", 1)[0]
    return f"    def {name}(" + body


def grounded() -> list[str]:
    """8 prompts whose answers copy from them (two passages x three asks, two code files)."""
    a = _passage("README.md", "#", 380)
    b = _passage("docs/serving.md", "#", 380)
    out = []
    for p, (old, new) in ((a, ("tensor", "matrix")), (b, ("request", "query"))):
        out += [f"{p}\n\nRepeat the text above word for word, but write \"{new}\" instead "
                f"of \"{old}\".",
                f"{p}\n\nSummarise the text above in a few sentences.",
                f"{p}\n\nExtract every name of a program, library or flag in the text "
                f"above, as a list."]
    for path, fn, new in (("src/tpkit/serve/scheduler.py", "schedule", "plan_step"),
                          ("src/tpkit/serve/engine.py", "step", "run_once")):
        out.append(f"```python\n{_code(path, fn)}```\n\nRename the function `{fn}` to "
                   f"`{new}` and write out the whole function.")
    return out


def contenders(args) -> list[Contender]:
    """tpkit with and without --speculative, and the llama-servers given."""
    hf, out, src = Path(args.hf), [], {"PYTHONPATH": str(ROOT / "src")}
    for dtype in ("float32", "bfloat16"):
        draft = [["--speculative", "draft", "--draft-checkpoint", args.draft,
                  *args.tpkit_arg]] if args.draft else []
        for spec in ([], ["--speculative", "ngram", *args.tpkit_arg], *draft):
            out.append(Contender(
                " ".join(["tpkit", dtype, *spec]),
                [*TPKIT, "serve", "--checkpoint", str(hf), "--dtype", dtype, "--max-batch",
                 "8", "--max-len", "2048", "--served-model-name", "m", "--port", "{port}",
                 *spec], "m", 0, src))
    ggufs = dict(g.split("=", 1) for g in args.gguf)
    for kind, path in ggufs.items():
        if not args.llama_server or not Path(args.llama_server).is_file():
            print(f"skipped llama-server: no program at {args.llama_server}", flush=True)
            break
        for spec in ([], *(["--spec-type", t] for t in args.llama_spec)):
            out.append(Contender(
                " ".join([f"llama-server {kind}", *spec]),
                [args.llama_server, "-m", path, "-t", "2", "-np", "8", "-c", "16384",
                 "--host", "127.0.0.1", "--port", "{port}", "--jinja", *spec],
                "m", 0, extra_body={"cache_prompt": False}))
    keep = [k for k in args.only.split(",") if k]
    return [c for c in out if not keep or any(k in c.name for k in keep)]


def ask(port: int, c: Contender, prompt: str, max_tokens: int) -> tuple[str, int, int, int]:
    """One greedy chat completion: (text, output tokens, drafted, accepted) (the last
    two: llama.cpp's timings, else 0)."""
    body = {"model": c.model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, **c.extra_body}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.load(r)
    t = out.get("timings") or {}
    return (out["choices"][0]["message"]["content"] or "", out["usage"]["completion_tokens"],
            t.get("draft_n", 0), t.get("draft_n_accepted", 0))


def level(port: int, c: Contender, prompts: list[str], clients: int, max_tokens: int):
    """Output tokens/s of `clients` closed-loop clients over `prompts`; the texts, drafted
    and accepted tokens (llama.cpp's)."""
    wall, answers = closed_loop(prompts, clients, lambda prompt: ask(port, c, prompt, max_tokens))
    tokens, drafted, accepted = (sum(a[j] for a in answers) for j in (1, 2, 3))
    return tokens / wall, [a[0] for a in answers], drafted, accepted


def _spec_metrics(port: int) -> tuple[float, float]:
    """tpkit's (proposed, accepted) tokens so far from /metrics ((0, 0) without)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    got = [re.search(rf"^tpkit_spec_{k}_tokens_total (\S+)$", text, re.M)
           for k in ("proposed", "accepted")]
    return tuple(float(m.group(1)) if m else 0.0 for m in got)


def one_round(c: Contender, sets: dict, levels: list[int], max_tokens: int, log: Path):
    """Start `c`, measure every (prompt set, level), stop it: {(set, clients): (tokens/s,
    texts, proposed, accepted)}, and the load before and after."""
    load0 = loadavg()
    proc, port = start(c, log)
    res = {}
    try:
        ask(port, c, OPEN[0], 4)  # warm-up
        for name, prompts in sets.items():
            for n in levels:
                before = _spec_metrics(port) if c.name.startswith("tpkit") else (0, 0)
                tps, texts, drafted, accepted = level(port, c, prompts[:max(2, n)], n,
                                                      max_tokens)
                if c.name.startswith("tpkit"):
                    after = _spec_metrics(port)
                    drafted, accepted = after[0] - before[0], after[1] - before[1]
                res[name, n] = (tps, texts, drafted, accepted)
        return res, (load0, loadavg())
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="SmolLM2-135M-Instruct's HF folder")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--gguf", action="append", default=[], help="KIND=FILE (F32, BF16)")
    ap.add_argument("--llama-spec", action="append", default=None,
                    help="llama-server --spec-type values (default: ngram-simple)")
    ap.add_argument("--tpkit-arg", action="append", default=[],
                    help="added to tpkit's speculative command line (--tpkit-arg=X)")
    ap.add_argument("--draft", default=None,
                    help="a draft model's folder (benchmarks/smollm2_draft.py): adds tpkit "
                         "--speculative draft contenders")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--only", default="", help="comma-separated name parts to keep")
    ap.add_argument("--sets", default="grounded,ungrounded", help="prompt sets to run")
    ap.add_argument("--log", default="/tmp/serve_speculative.log")
    args = ap.parse_args()
    args.llama_spec = args.llama_spec or ["ngram-simple"]
    levels = [int(x) for x in args.clients.split(",")]
    sets = {k: v for k, v in (("grounded", grounded()), ("ungrounded", OPEN))
            if k in args.sets.split(",")}
    cs, log = contenders(args), Path(args.log)
    results = {c.name: [] for c in cs}
    for r in range(args.rounds):
        for c in cs[r % len(cs):] + cs[:r % len(cs)]:
            res, load = one_round(c, sets, levels, args.max_tokens, log)
            results[c.name].append((res, load))
            print(f"round {r + 1} {c.name}: " + ", ".join(
                f"{s}/{n} {v[0]:.1f} tok/s" for (s, n), v in res.items()) +
                f" (load {load[0]:.1f} -> {load[1]:.1f})", flush=True)
    table(cs, results, sets, levels)


def table(cs, results, sets, levels) -> None:
    """The medians, the ratio to the same dtype without speculation, acceptance, texts."""
    print("\n| contender | " + " | ".join(f"{s} {n} client{'s' * (n > 1)} tok/s (x base)"
                                          for s in sets for n in levels) +
          " | acceptance (grounded, ungrounded) | load | texts |")
    print("|---" * (len(sets) * len(levels) + 4) + "|")
    for c in cs:
        runs = results[c.name]
        base = next(b for b in cs if b.name.split(" --")[0] == c.name.split(" --")[0])
        cells = []
        for s in sets:
            for n in levels:
                med = statistics.median(r[s, n][0] for r, _ in runs)
                ratio = statistics.median(r[s, n][0] / b[s, n][0] for (r, _), (b, _) in
                                          zip(runs, results[base.name]))
                cells.append(f"{med:.1f} ({ratio:.2f}x)")
        acc = []
        for s in sets:
            d = sum(r[s, n][2] for r, _ in runs for n in levels)
            a = sum(r[s, n][3] for r, _ in runs for n in levels)
            acc.append(f"{a / d:.0%} of {d:.0f}" if d else "-")
        loads = [x for _, ld in runs for x in ld]
        diff = "; ".join(f"{s}/{n}: {d}" for s in sets for n in levels
                         if (d := first_difference(runs[0][0][s, n][1],
                                                   results[base.name][0][0][s, n][1])))
        print(f"| {c.name} | " + " | ".join(cells) + f" | {', '.join(acc)} | "
              f"{min(loads):.1f}-{max(loads):.1f} | {diff or 'same'} |")


if __name__ == "__main__":
    main()
