"""What an adversarial client does to `tpkit serve`, through real HTTP (conftest's
in-process server, tp=1): 1 MiB bodies of the shapes that are hardest to scan (deep
nesting, strings of escapes that never close, many small strings) are each a 400
while a stream runs on and /health answers, the nesting scan being linear; a
non-streamed request whose client hangs up is cancelled, its slots freed; a 413 for a
large body and a 404 for an unknown path say so in their codes. At tp=2, a follower
waits for rank 0's next step however long rank 0 takes to plan it (no heartbeat, a
collective timeout much shorter than the pause).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from checkpoint_helpers import LLAMA, fill, random_full
from test_serve_edge import post, stream_into, text_of
from tpkit.launch import SpawnError, WorkerPool
from tpkit.model.transformer import Transformer
from tpkit.serve import Engine, SamplingParams
from tpkit.serve.openai_api import MAX_BODY, ApiError
from tpkit.serve.protocol import MAX_DEPTH, depth, parse_json
from tpkit.serve.runner import Runner

MIB = MAX_BODY  # the server's default body limit: 1 MiB


def _fill(head: bytes, unit: bytes, tail: bytes = b"") -> bytes:
    """head + unit repeated + tail, MIB bytes at most (as large as the server takes)."""
    return head + unit * ((MIB - len(head) - len(tail)) // len(unit)) + tail


DEEP = f"nests deeper than {MAX_DEPTH} levels"
HOSTILE = {  # name -> (a 1 MiB body, its nesting depth, what its 400 says)
    # the probe's: 17 brackets, then a string of escaped quotes that never closes (the
    # old scan tried its string pattern again from each quote: quadratic, about an hour)
    "unclosed escapes": (_fill(b'{"prompt":' + b"[" * 17 + b'"', b'\\"'), 18, DEEP),
    "deep": (b"[" * MIB, MIB, DEEP),
    "escapes 17 deep": (_fill(b'{"prompt":' + b"[" * 16 + b'"', b"\\\\",
                              b'"' + b"]" * 16 + b"}"), 17, DEEP),
    "small strings": (_fill(b'{"prompt":' + b"[" * 17, b'"",'), 18, DEEP),
    "siblings 17 deep": (_fill(b"[", b"[" * 17 + b"]" * 17 + b",", b"[]]"), 18, DEEP),
    "brackets in strings": (_fill(b'{"prompt":[', b'"[{",', b'"a"]}'), 2,
                            "at most 32 per request"),  # JSON, not deep: a batch too big
}


@pytest.fixture(scope="module")
def server(openai_server):
    """(base URL, OpenAI client, engine) of conftest's in-process server."""
    return openai_server


def test_the_depth_limit_and_what_it_skips():
    ok = b'{"prompt": "x", "stop": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert depth(ok) == MAX_DEPTH and parse_json(ok)["prompt"] == "x"
    over = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    with pytest.raises(ApiError, match=f"nests deeper than {MAX_DEPTH} levels"):
        parse_json(over)
    quoted = b'{"p": "' + b"[" * 40 + b'\\"' + b"{" * 40 + b'", "q": [1]}'
    assert depth(quoted) == 2 and parse_json(quoted)["p"].startswith("[[")  # in strings
    unclosed = b'{"p": "\\"' + b"[" * 40  # a string to the end: what follows is in it
    assert depth(unclosed) == 1
    with pytest.raises(ApiError, match="not JSON"):
        parse_json(unclosed)
    for name, (raw, deep, _) in HOSTILE.items():
        assert len(raw) > MIB - 40 and depth(raw) == deep, name


def _health(port: int, answers: list, stop: threading.Event) -> None:
    while True:  # once at least
        status, got, _ = post(port, "/health", None, method="GET")
        answers.append((status, got))
        if stop.is_set():
            return


def test_hostile_1_mib_bodies_are_400s_while_health_and_a_stream_go_on(server):
    url, client, engine = server
    port, kw = int(url.rsplit(":", 1)[1]), dict(max_tokens=100, temperature=0,
                                                extra_body={"ignore_eos": True})
    out: list = []
    stream = stream_into(client, out, **kw)
    submitted, answers, stop = engine._ids, [], threading.Event()
    health = threading.Thread(target=_health, args=(port, answers, stop))
    health.start()
    try:
        for name, (raw, _, why) in HOSTILE.items():
            status, got, _ = post(port, "/v1/completions", raw)
            assert status == 400 and why in got["error"]["message"], (name, got)
    finally:
        stop.set()
        health.join(timeout=60)
    assert answers and all(a == (200, {"status": "ok"}) for a in answers)
    assert engine._ids == submitted  # none reached the engine
    stream.join(timeout=120)
    assert "".join(out) == text_of(client, **kw)  # the stream ended with its normal text


def test_a_non_streamed_request_whose_client_hangs_up_is_cancelled(server):
    """32 prompts x n=16 x 100 tokens (minutes of work for 4 slots), then the client
    goes: all 512 are cancelled and the slots freed (they used to run to the end)."""
    url, _, engine = server
    before = engine.metrics.requests["cancelled"]
    body = json.dumps({"model": "llama", "prompt": ["Tensor"] * 32, "n": 16,
                       "max_tokens": 100, "ignore_eos": True, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 60
    while engine.metrics.requests["cancelled"] == before and not engine.busy and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    sock.close()  # gone while its answer is being generated
    while engine.metrics.requests["cancelled"] < before + 512 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.metrics.requests["cancelled"] == before + 512
    while engine.busy and time.monotonic() < deadline:  # the next step drops them
        time.sleep(0.05)
    assert not engine.busy


def test_error_codes_say_what_went_wrong(server):
    url, client, _ = server
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # no body sent:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % (MIB + 1))
        head, _, got = sock.makefile("rb").read().partition(b"\r\n\r\n")  # refused unread
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(got)["error"]["code"] == "request_too_large", got
    status, got, _ = post(port, "/v1/nowhere", {"prompt": "x"})
    assert status == 404 and got["error"]["code"] == "not_found", got
    status, got, _ = post(port, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and got["error"]["code"] == "model_not_found", got


# -- tp=2: a follower waits for rank 0 as long as it lives -----------------------------
TIMEOUT_S, PAUSE_S = 2.0, 4.0  # the collective timeout; rank 0's pause between requests


def slow_leader(mesh):
    """Rank 0: a request, a pause longer than the collective timeout (rank 0 busy, no
    heartbeat), the same request; the follower runs both. Returns its tokens twice."""
    model = Transformer(LLAMA, mesh)
    fill(model, random_full(LLAMA, seed=5, scale=1.0), mesh)
    assert model.group.shm is not None  # the transport whose wait this tests
    if mesh.tp_rank != 0:
        return Runner(model).follow()
    engine = Engine(model, max_batch=2, max_len=32)
    first = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].tokens
    time.sleep(PAUSE_S)
    second = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].tokens
    engine.runner.lead_stop()
    return first, second


def dying_leader(mesh):
    """Rank 0: a request, then its process dies (no STOP) while the follower waits."""
    model = Transformer(LLAMA, mesh)
    fill(model, random_full(LLAMA, seed=5, scale=1.0), mesh)
    if mesh.tp_rank != 0:
        return Runner(model).follow()
    Engine(model, max_batch=2, max_len=32).generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    os._exit(3)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_follower_waits_for_a_slow_rank_0_beyond_the_collective_timeout():
    """...as long as rank 0 lives: once it dies, the follower fails at once, naming it."""
    pool = WorkerPool(2, timeout=90, threads=1, pg_timeout_s=TIMEOUT_S)
    try:
        (first, second), steps = pool.run(slow_leader, mesh=dict(tp=2, comm="shm"))
        assert first == second and len(first) == 4 and steps > 0
        with pytest.raises(SpawnError, match=r"rank 0 died \(exit code 3\).*rank 1: recv over "
                           r"tp \[0, 1\] \(scope serve.plan, forward\) failed after .*it died"):
            pool.run(dying_leader, mesh=dict(tp=2, comm="shm"))
    finally:
        pool.close()
