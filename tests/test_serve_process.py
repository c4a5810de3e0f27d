"""`tpkit serve --tp 2` as a user runs it (a subprocess on a free loopback port), with the
`openai` client: 16 concurrent greedy requests each equal to its solo output and to
tp=1's; with `--lora one=PEFT`, the adapter's requests beside the base's give tp=1's
merged model's text and the base's their text without it; a seed of 2^64 refused (400) and a temperature of 1e-300 greedy; SIGTERM with requests in flight (each ends, the server exits 143 within
seconds, no process left); kill -9 of the rank-1 worker (its requests get 503, the
server exits 1 with one line naming the rank, no process left).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from helpers import generate_args
from hf_folders import lora_folders, tiny_llama_folder
from tpkit.commands import generate as generate_cmd
from tpkit.mesh import ParallelMesh
from tpkit.weights.sources import open_source
from tpkit.weights.tokenizer import load_tokenizer

SRC = str(Path(__file__).resolve().parents[1] / "src")
TEXTS = [" ".join(["Tensor parallelism splits the weight"] * (1 + i % 5))[: 4 + 7 * i]
         for i in range(16)]  # 16 prompts of 4..109 characters

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("served") / "llama", initializer_range=0.3)


@pytest.fixture(scope="module")
def lora(folder, tmp_path_factory):
    """(PEFT adapter folder, merged model) over `folder` (`tpkit serve --lora`)."""
    return lora_folders(folder, tmp_path_factory.mktemp("lora"))


def children(pid: int) -> set[int]:
    """Every process descended from `pid` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


def alive(pids: set[int], within: float = 5.0) -> set[int]:
    """Those of `pids` still running after `within` seconds (the forkserver and the
    resource tracker end on their own once the server is gone)."""
    deadline = time.monotonic() + within
    while True:
        left = set()
        for p in pids:
            try:
                if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    left.add(p)
            except OSError:
                pass
        if not left or time.monotonic() > deadline:
            return {(p, _cmdline(p)) for p in left}
        time.sleep(0.1)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()[:80]
    except OSError:
        return b"(gone)"


class Served:
    """`tpkit serve --tp N --port 0` in a subprocess, its URL read from its first line."""

    def __init__(self, folder: Path, tp: int, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tpkit", "serve", "--checkpoint", str(folder), "--tp",
             str(tp), "--port", "0", "--max-batch", "4", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": SRC})
        line = self.proc.stdout.readline()  # printed once the model is loaded
        assert line.startswith("tpkit serve: http://127.0.0.1:"), (line, self.stderr())
        self.url = line.split()[2]
        kv = self.proc.stdout.readline()  # the KV cache's ceiling, said at start
        assert re.match(r"tpkit serve: KV cache: at most [\d.]+ MiB per rank \(\d+ blocks "
                        r"of 16 tokens\), taken as tokens arrive; prefix cache on", kv), kv
        self.client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0,
                                    timeout=60)
        self.pids = children(self.proc.pid) | {self.proc.pid}

    def stderr(self) -> str:
        return self.proc.stderr.read() if self.proc.poll() is not None else ""

    def complete(self, prompt: str, model: str = "llama", **kw) -> str:
        r = self.client.completions.create(model=model, prompt=prompt, temperature=0, **kw)
        return r.choices[0].text

    def stream(self, out: list, **kw) -> None:
        """A streamed completion; appends ("first",), then ("end", reason) or ("error", e)."""
        try:
            s = self.client.completions.create(model="llama", prompt="Tensor", stream=True,
                                               temperature=0, extra_body={"ignore_eos": True},
                                               **kw)
            for c in s:
                if not out:
                    out.append(("first",))
                if c.choices and c.choices[0].finish_reason:
                    out.append(("end", c.choices[0].finish_reason))
        except Exception as e:  # noqa: BLE001 - what the client saw is the result
            out.append(("error", f"{type(e).__name__}: {e}"))

    def kill(self) -> None:
        for p, _ in alive(self.pids, within=0):
            os.kill(p, signal.SIGKILL)


def _in_flight(served: Served, n: int) -> tuple[list[list], list[threading.Thread]]:
    outs = [[] for _ in range(n)]
    threads = [threading.Thread(target=served.stream, args=(o,), kwargs={"max_tokens": 110})
               for o in outs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(outs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(outs), outs  # every request is streaming
    return outs, threads


@pytest.mark.timeout(240)
def test_tp2_concurrent_equals_alone_and_tp1_then_sigterm(folder, lora):
    served = Served(folder, 2, "--batch-invariant", "--lora", f"one={lora[0]}")
    try:
        alone = [served.complete(t, max_tokens=12) for t in TEXTS]
        with ThreadPoolExecutor(len(TEXTS)) as pool:
            together = list(pool.map(lambda t: served.complete(t, max_tokens=12), TEXTS))
        assert together == alone and len(set(alone)) > 8
        args = generate_args("--checkpoint", str(folder),
                             *(a for t in TEXTS for a in ("--prompt", t)),
                             "--max-new-tokens", "12", "--max-batch", "4", "--batch-invariant", "--decode-chunk", "8")
        tok = load_tokenizer(folder)  # tp=1, in this process: the same text
        new = generate_cmd._lead(ParallelMesh.single(), args, open_source(folder))["new"]
        assert [tok.decode(n) for n in new] == alone
        # --lora one=: its requests beside the base's, as tp=1's merged model served alone
        asks = [(m, t) for t in TEXTS[:4] for m in ("one", "llama")]
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(lambda a: served.complete(a[1], max_tokens=12, model=a[0]),
                                asks))
        assert got[1::2] == alone[:4]
        args.checkpoint, args.prompt = str(lora[1]), TEXTS[:4]
        new = generate_cmd._lead(ParallelMesh.single(), args, open_source(lora[1]))["new"]
        assert got[::2] == [tok.decode(n) for n in new] != alone[:4]
        # what used to end the server (a traceback, exit): a 400, and greedy
        with pytest.raises(openai.BadRequestError, match="seed=18446744073709551616"):
            served.complete(TEXTS[3], max_tokens=12, seed=1 << 64)
        tiny = served.client.completions.create(model="llama", prompt=TEXTS[3], max_tokens=12,
                                                temperature=1e-300, seed=5)
        assert tiny.choices[0].text == alone[3]
        served.pids |= children(served.proc.pid)
        outs, threads = _in_flight(served, 3)
        t0 = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=30) == 128 + signal.SIGTERM
        took = time.monotonic() - t0
        for t in threads:
            t.join(timeout=10)
        assert all(o[-1][0] in ("end", "error") for o in outs), outs  # each one ended
        assert took < 15, took  # drain 5 s, then cancel
        assert "stopped by SIGTERM" in served.stderr()
        assert not alive(served.pids), alive(served.pids)
    finally:
        served.kill()


@pytest.mark.timeout(180)
def test_kill_9_of_a_worker_gives_503_and_one_line(folder):
    # --decode-chunk reaches rank 1: run with another chunk than rank 0's, its forwards
    # would not match and the requests would fail before the kill
    served = Served(folder, 2, "--batch-invariant", "--decode-chunk", "1")
    try:
        ids = load_tokenizer(folder).encode("Tensor parallelism splits")  # echo at tp=2:
        r = served.client.completions.create(  # rank 1 scores every position too
            model="llama", prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True)
        got = r.choices[0].logprobs.token_logprobs
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1], -1)
        ref = [float(logp[t, i]) for t, i in enumerate(ids[1:])]
        assert got[0] is None and max(abs(a - b) for a, b in zip(got[1:len(ids)], ref)) < 1e-4
        served.pids |= children(served.proc.pid)
        forkserver = [p for p in served.pids if p in children(served.proc.pid) and
                      children(p)]  # the workers' parent
        rank1 = [c for f in forkserver for c in children(f)]
        assert len(rank1) == 1, (forkserver, rank1)
        outs, threads = _in_flight(served, 2)  # 110 tokens take ~0.1 s: kill at once
        os.kill(rank1[0], signal.SIGKILL)
        assert served.proc.wait(timeout=60) == 1
        for t in threads:
            t.join(timeout=10)
        assert all(o[-1][0] == "error" and "503" in o[-1][1] or "rank 1 died" in o[-1][1]
                   for o in outs), outs
        err = served.stderr()
        assert "tpkit serve: error: rank 1 died (signal 9)" in err, err
        assert not alive(served.pids), alive(served.pids)
    finally:
        served.kill()
