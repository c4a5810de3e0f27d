"""OpenAI-API servers side by side on the same weights, each started through its real CLI:
`tpkit serve` (tp=1 and tp=2, float32 and bfloat16, and --quantize int8 where that flag
exists), `transformers serve --continuous-batching`, and llama.cpp's `llama-server`
(F32, BF16, Q8_0 GGUFs of the same folder). Not part of `make test`.

    .venv/bin/python benchmarks/serve_peers.py --hf SMOLLM2 \\
        --llama-server LLAMA/build/bin/llama-server \\
        --gguf F32=smollm2-f32.gguf --gguf BF16=smollm2-bf16.gguf --gguf Q8_0=smollm2-q8_0.gguf \\
        [--rounds 5] [--clients 1,8] [--max-tokens 64] [--only tpkit,llama]

(or LLAMA_SERVER=... and SERVE_PEERS_GGUF_F32=... / _BF16 / _Q8_0 in the environment;
`--llama-arg=X`, repeatable, adds X to llama-server's command line, e.g.
`--llama-arg=--no-repack`). On a VM that advertises AMX without running it, a build with
GGML_NATIVE=ON dies of SIGILL in its AMX Q8_0 kernel: build it with GGML_NATIVE=OFF and
the AVX-512 flags instead (docs/benchmarks.md).
A contender whose program or file is missing is skipped with a line saying so. The GGUFs
come from llama.cpp's own converter, e.g. `python LLAMA/convert_hf_to_gguf.py SMOLLM2
--outtype f32 --outfile smollm2-f32.gguf` (bf16, q8_0 alike; it needs `gguf` and
`sentencepiece`; PYTHONPATH=LLAMA/gguf-py); `--make-ggufs LLAMA/convert_hf_to_gguf.py
--gguf-dir D` runs it. Every server holds 8 sequences of up to 1024 tokens (tpkit
`--max-batch 8 --max-len 1024`, llama-server `-np 8 -c 8192`).

Each round starts every contender in turn (the order rotates from round to round), waits
until it answers, sends one warm-up request, then drives it with the `openai` client:
greedy chat completions of `--max-tokens` new tokens, first from 1 client (two prompts one
after the other), then from 8 concurrent clients (one prompt each, 8 different), and stops
it. The figure is output tokens (the server's `usage`) summed over the wall time of the
level; the table shows the median over the rounds. The load average is read before and
after each contender. The machine's memory bandwidth is measured first (a large numpy
copy: read + write bytes/s, best of 5), and each contender's weight bytes read per second
at one client (its weights' bytes x tokens/s: one pass over the weights per token) is
given as a fraction of it. Every contender's greedy texts are compared with the first
contender's; where they differ the table says at which prompt and character.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TPKIT = [sys.executable, "-m", "tpkit"]
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle stays upright, step by step.",
    "Describe the water cycle to a ten-year-old.",
    "Write a letter to a friend about your trip to the mountains.",
    "What are the benefits of reading books every day? Give several reasons.",
    "Explain how bread is made, from flour to loaf.",
    "Describe a busy market in the morning.",
    "Write a recipe for a simple vegetable soup and explain each step.",
]
GGUF_KINDS = ("F32", "BF16", "Q8_0")


@dataclass
class Contender:
    """One server: its command line (given the port), the model name its API expects,
    and the bytes of weights it reads per decode step (for the bandwidth fraction)."""

    name: str
    argv: list[str]
    model: str
    weight_bytes: int
    env: dict[str, str] = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_weight_bytes(folder: Path, bytes_per_value: int) -> int:
    """Bytes of the folder's weights held in a dtype of `bytes_per_value` (from float32)."""
    total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return total * bytes_per_value // 4


def tpkit_flags(name: str) -> bool:
    """Whether `tpkit serve --help` lists the flag `name` (e.g. --quantize)."""
    out = subprocess.run([*TPKIT, "serve", "--help"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return name in out.stdout


def contenders(args, say) -> list[Contender]:
    """Every contender this machine has; each missing one is skipped with a line saying why.
    To add one, append a Contender here: the rest of the script needs nothing else."""
    hf, out = Path(args.hf), []
    src = {"PYTHONPATH": str(ROOT / "src")}
    for tp in (1, 2):
        for dtype, size in (("float32", 4), ("bfloat16", 2)):
            out.append(Contender(
                f"tpkit serve tp={tp} {dtype}",
                [*TPKIT, "serve", "--checkpoint", str(hf), "--tp", str(tp), "--dtype", dtype,
                 "--max-batch", "8", "--max-len", "1024", "--served-model-name", "m",
                 "--port", "{port}"],
                "m", hf_weight_bytes(hf, size), src))
    if tpkit_flags("--quantize"):
        for tp in (1, 2):
            out.append(Contender(
                f"tpkit serve tp={tp} int8",
                [*TPKIT, "serve", "--checkpoint", str(hf), "--tp", str(tp), "--quantize", "int8",
                 "--max-batch", "8", "--max-len", "1024", "--served-model-name", "m",
                 "--port", "{port}"],
                "m", hf_weight_bytes(hf, 1), src))
    else:
        say("skipped tpkit serve --quantize int8: this tpkit serve has no --quantize flag")
    tf = shutil.which("transformers", path=str(Path(sys.executable).parent)) \
        or shutil.which("transformers")
    if tf is None:
        say("skipped transformers serve: no `transformers` program next to this Python or on PATH")
    else:
        for dtype, size in (("float32", 4), ("bfloat16", 2)):
            out.append(Contender(
                f"transformers serve --continuous-batching {dtype}",
                [tf, "serve", "--continuous-batching", "--dtype", dtype, "--device", "cpu",
                 "--host", "127.0.0.1", "--port", "{port}", str(hf)],
                str(hf), hf_weight_bytes(hf, size)))
    server = args.llama_server or os.environ.get("LLAMA_SERVER")
    ggufs = dict(g.split("=", 1) for g in args.gguf)
    for kind in GGUF_KINDS:
        path = ggufs.get(kind) or os.environ.get(f"SERVE_PEERS_GGUF_{kind}")
        if not server or not Path(server).is_file():
            say(f"skipped llama-server {kind}: no llama-server (--llama-server or LLAMA_SERVER; "
                f"given: {server or 'nothing'})")
        elif not path or not Path(path).is_file():
            say(f"skipped llama-server {kind}: no {kind} GGUF (--gguf {kind}=FILE or "
                f"SERVE_PEERS_GGUF_{kind}; given: {path or 'nothing'})")
        else:
            out.append(Contender(
                " ".join([f"llama-server {kind} -t 2 -np 8", *args.llama_arg]),
                [server, "-m", path, "-t", "2", "-np", "8", "-c", "8192", "--host", "127.0.0.1",
                 "--port", "{port}", "--jinja", *args.llama_arg],
                "m", Path(path).stat().st_size, extra_body={"cache_prompt": False}))
    keep = [k for k in args.only.split(",") if k] if args.only else []
    return [c for c in out if not keep or any(k in c.name for k in keep)]


def memory_bandwidth() -> float:
    """Read + write bytes/s of a 256 MiB numpy copy, best of 5 (one thread)."""
    import numpy as np

    a = np.ones(64 << 20, dtype=np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


def loadavg() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def start(c: Contender, log: Path) -> tuple[subprocess.Popen, int]:
    """Start `c` on a free port and wait until /v1/models answers."""
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in c.argv]
    proc = subprocess.Popen(argv, stdout=log.open("a"), stderr=subprocess.STDOUT,
                            env={**os.environ, **c.env}, start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{c.name} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"{c.name} did not answer in 900 s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL it after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def ask(client, c: Contender, prompt: str, max_tokens: int) -> tuple[str, int]:
    """One greedy chat completion: (text, output tokens)."""
    r = client.chat.completions.create(
        model=c.model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, extra_body=c.extra_body or None)
    return r.choices[0].message.content or "", r.usage.completion_tokens


def closed_loop(work: list, clients: int, answer) -> tuple[float, list]:
    """`clients` threads sharing `work` in a closed loop (each takes the next item once its
    answer is back): (wall seconds, `answer(item)` for each item, in `work`'s order)."""
    todo, answers, lock = list(enumerate(work)), [None] * len(work), threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, item = todo.pop(0)
            answers[i] = answer(item)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, answers


def level(client, c: Contender, clients: int, max_tokens: int) -> tuple[float, list[str]]:
    """Output tokens/s of `clients` clients sharing the first max(2, clients) PROMPTS (closed
    loop); the texts by prompt."""
    wall, answers = closed_loop(PROMPTS[:max(2, clients)], clients,
                                lambda prompt: ask(client, c, prompt, max_tokens))
    return sum(n for _, n in answers) / wall, [text for text, _ in answers]


def one_round(c: Contender, levels: list[int], max_tokens: int, log: Path) -> dict:
    """Start `c`, measure every level, stop it."""
    from openai import OpenAI

    load0 = loadavg()
    proc, port = start(c, log)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=900,
                        max_retries=0)
        ask(client, c, PROMPTS[0], 4)  # warm-up
        res = {"load": [load0]}
        for n in levels:
            res[n] = level(client, c, n, max_tokens)
        res["load"].append(loadavg())
        return res
    finally:
        stop(proc)


def first_difference(a: list[str], b: list[str]) -> str:
    """'' when the texts are equal, else where the first one differs."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"prompt {i + 1} from char {at}"
    return ""


def make_ggufs(convert: str, hf: str, into: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py: F32, BF16 and Q8_0 GGUFs of `hf` into `into`."""
    into.mkdir(parents=True, exist_ok=True)
    for kind in GGUF_KINDS:
        dest = into / f"model-{kind.lower()}.gguf"
        if not dest.is_file():
            subprocess.run([sys.executable, convert, hf, "--outtype", kind.lower(),
                            "--outfile", str(dest)], check=True, env={  # its own gguf-py
                                **os.environ, "PYTHONPATH": str(Path(convert).parent / "gguf-py")})
        print(f"--gguf {kind}={dest}")


def main() -> None:
    """CLI: the contenders, the rounds, the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="the Hugging Face folder every server reads")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server program")
    ap.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for llama-server (repeatable; e.g. "
                         "--llama-arg=--no-repack)")
    ap.add_argument("--gguf", action="append", default=[], metavar="KIND=FILE",
                    help=f"a GGUF of the same folder, KIND one of {', '.join(GGUF_KINDS)}")
    ap.add_argument("--make-ggufs", default=None, metavar="CONVERT_HF_TO_GGUF_PY",
                    help="first write the GGUFs with llama.cpp's converter into --gguf-dir")
    ap.add_argument("--gguf-dir", default="ggufs", help="where --make-ggufs writes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--only", default="", help="comma-separated name parts to keep")
    ap.add_argument("--log", default="serve_peers.log", help="the servers' output")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "serve_peers.json"))
    args = ap.parse_args()
    if args.make_ggufs:
        make_ggufs(args.make_ggufs, args.hf, Path(args.gguf_dir))
        args.gguf += [f"{k}={Path(args.gguf_dir) / f'model-{k.lower()}.gguf'}"
                      for k in GGUF_KINDS]
    levels = [int(x) for x in args.clients.split(",")]
    runs = contenders(args, print)
    if not runs:
        raise SystemExit("serve_peers: no contender to run")
    bw = memory_bandwidth()
    print(f"memory bandwidth (numpy copy, read + write): {bw / 1e9:.1f} GB/s; load {loadavg()}")
    log = Path(args.log)
    results: dict[str, list[dict]] = {c.name: [] for c in runs}
    for r in range(args.rounds):
        for i in range(len(runs)):
            c = runs[(r + i) % len(runs)]
            try:
                res = one_round(c, levels, args.max_tokens, log)
            except Exception as e:  # one broken server must not end the others' rounds
                print(f"round {r + 1}: {c.name} failed: {e}")
                continue
            results[c.name].append(res)
            print(f"round {r + 1}: {c.name}: " + ", ".join(
                f"{n} client{'s' * (n > 1)} {res[n][0]:.1f} tok/s" for n in levels)
                + f" (load {res['load'][0]:.1f} -> {res['load'][1]:.1f})", flush=True)
    table(runs, results, levels, bw, args)


def table(runs, results, levels, bw, args) -> None:
    """The markdown table, and the JSON of every round."""
    ref = next((results[c.name][0] for c in runs if results[c.name]), None)
    head = " | ".join(f"{n} client{'s' * (n > 1)} tok/s" for n in levels)
    print(f"\nmedians of {args.rounds} rounds, greedy, max_tokens {args.max_tokens}; "
          f"memory bandwidth {bw / 1e9:.1f} GB/s\n")
    print(f"| server | weights MB | {head} | weights GB/s at 1 client (share of bandwidth) "
          f"| load before -> after | greedy text |")
    print("|---|---:|" + "---:|" * len(levels) + "---:|---|---|")
    dump = {"bandwidth": bw, "prompts": PROMPTS, "contenders": {}}
    for c in runs:
        rs = results[c.name]
        if not rs:
            print(f"| {c.name} | {c.weight_bytes / 1e6:.0f} |" + " - |" * len(levels)
                  + " - | - | failed |")
            continue
        med = {n: statistics.median(x[n][0] for x in rs) for n in levels}
        gbs = c.weight_bytes * med[levels[0]] / 1e9
        diffs = {first_difference(x[n][1], ref[n][1]) for x in rs for n in levels} - {""}
        loads = [x["load"] for x in rs]
        print(f"| {c.name} | {c.weight_bytes / 1e6:.0f} | "
              + " | ".join(f"{med[n]:.1f}" for n in levels)
              + f" | {gbs:.1f} ({gbs * 1e9 / bw:.0%}) | "
              + f"{min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f} -> "
              + f"{min(x[1] for x in loads):.1f}-{max(x[1] for x in loads):.1f} | "
              + (f"differs: {'; '.join(sorted(diffs))}" if diffs else "same") + " |")
        dump["contenders"][c.name] = {"weight_bytes": c.weight_bytes, "median": med, "rounds": [
            {"load": x["load"], **{str(n): {"tokens_s": x[n][0], "texts": x[n][1]}
                                   for n in levels}} for x in rs]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dump, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
