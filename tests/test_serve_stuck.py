"""`tpkit serve --tp 2` with a frozen worker (SIGSTOP on rank 1), as an operator meets it:
/health turns 503 naming the rank; SIGTERM still stops the server (exit 143), the stream
in flight ends with a 503, one line names the stuck rank and no process is left; left
alone, the step's collective times out after `--collective-timeout` and the server
exits 1 with the stream's 503 and a line giving the real seconds waited and the step.
At tp=1 (conftest's in-process server), a step in flight past `STUCK_S` is a 503 too.

The waits are bounds (a hang check), never timings.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
from urllib.error import HTTPError
from urllib.request import urlopen

import pytest

from test_serve_process import Served, alive, children

TIMEOUT_S = 4.0  # --collective-timeout of the stuck test


def health(served: Served) -> tuple[int, dict]:
    try:
        with urlopen(served.url.removesuffix("/v1") + "/health", timeout=30) as r:
            return r.status, json.loads(r.read())
    except HTTPError as e:
        return e.code, json.loads(e.read())


def rank1(served: Served) -> int:
    """The rank-1 worker's pid: the one child of the forkserver (the server's child with
    children of its own)."""
    forkserver = [p for p in children(served.proc.pid) if children(p)]
    workers = [c for f in forkserver for c in children(f)]
    assert len(workers) == 1, (forkserver, workers)
    return workers[0]


def stream(served: Served, out: list) -> None:
    """A streamed completion read as raw server-sent events: appends "first" at the first
    token, then the error event's JSON if one comes, then "end"."""
    host, port = served.url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps({"model": "llama", "prompt": "Tensor", "max_tokens": 110,
                       "temperature": 0, "stream": True, "ignore_eos": True})
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.append(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.append(event["error"])
            elif not out:
                out.append("first")
    except OSError as e:
        out.append(f"{type(e).__name__}: {e}")
    finally:
        conn.close()
        out.append("end")


def _started(served: Served) -> tuple[list, threading.Thread, int]:
    """A stream in flight (its first token came) and rank 1's pid."""
    assert health(served) == (200, {"status": "ok"})
    served.pids |= children(served.proc.pid)
    pid = rank1(served)
    out: list = []
    t = threading.Thread(target=stream, args=(served, out), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not out and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out[:1] == ["first"], out
    return out, t, pid


def _until(check, within: float = 60.0):
    """check()'s first truthy value, polled for at most `within` seconds (a bound)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.1)
    return check()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stopped_worker_fails_health_and_sigterm_still_stops_the_server(chat_llama):
    served = Served(chat_llama, 2)
    try:
        out, t, pid = _started(served)
        os.kill(pid, signal.SIGSTOP)
        got = _until(lambda: (h := health(served))[0] == 503 and h)
        assert got, health(served)  # today: 200 throughout
        status, body = got
        assert status == 503 and f"rank 1 (pid {pid}) is stopped" in body["reason"], body
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=60) == 128 + signal.SIGTERM  # not ~300 s, not 1
        t.join(timeout=30)
        assert out[-1] == "end" and out[-2]["type"] == "service_unavailable", out  # 503
        assert out[-2]["message"] == "the server is shutting down", out
        err = served.stderr()
        assert len(re.findall(f"rank 1 \\(pid {pid}\\) is stopped", err)) == 1, err
        assert "stopped by SIGTERM" in err and "Traceback" not in err, err
        assert not alive(served.pids), alive(served.pids)
    finally:
        served.kill()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_stuck_past_the_collective_timeout_gives_503_and_a_true_line(chat_llama):
    # 4 s: rank 1 waits for rank 0's steps as long as rank 0 lives (ShmChannel.patient),
    # so the timeout bounds only a collective of a step, the one rank 1 is stopped in
    served = Served(chat_llama, 2, "--collective-timeout", str(TIMEOUT_S))
    try:
        out, t, pid = _started(served)
        os.kill(pid, signal.SIGSTOP)
        assert served.proc.wait(timeout=60) == 1
        t.join(timeout=30)
        assert out[-2]["type"] == "service_unavailable", out  # 503, not 500
        assert f"rank 1 (pid {pid}) is stopped" in out[-2]["message"], out
        err = served.stderr()
        line = [x for x in err.splitlines() if "tpkit serve: error:" in x]
        assert len(line) == 1 and f"rank 1 (pid {pid}) is stopped" in line[0], err
        waited = re.search(r"timed out after ([\d.]+) s", line[0])
        assert waited and float(waited.group(1)) >= TIMEOUT_S, line  # the seconds it waited
        step = re.search(r"last step completed: (\d+)", line[0])
        assert step and int(step.group(1)) >= 1, line  # the stream's tokens came
        assert "Traceback" not in err, err
        assert not alive(served.pids), alive(served.pids)
    finally:
        served.kill()


def test_a_step_in_flight_too_long_is_a_503_of_health(openai_server, monkeypatch):
    """The rule for a worker stuck without a sign /proc shows (a deadlock): a step in
    flight for over `STUCK_S` (made 0.5 s here, the step held until /health said so)."""
    from tpkit.serve import loop

    url, client, engine = openai_server
    served = Served.__new__(Served)
    served.url = url + "/v1"
    assert health(served) == (200, {"status": "ok"})
    monkeypatch.setattr(loop, "STUCK_S", 0.5)
    gate, lead_step = threading.Event(), engine.runner.lead_step
    monkeypatch.setattr(engine.runner, "lead_step", lambda *a: (gate.wait(60), lead_step(*a))[1])
    t = threading.Thread(target=client.completions.create,
                         kwargs=dict(model="llama", prompt="Tensor", max_tokens=2))
    t.start()
    got = _until(lambda: (h := health(served))[0] == 503 and h)
    gate.set()
    t.join(timeout=60)
    assert got and "(over 0.5 s): a worker may be stuck" in got[1]["reason"], got
    assert _until(lambda: health(served) == (200, {"status": "ok"}))  # the step returned
