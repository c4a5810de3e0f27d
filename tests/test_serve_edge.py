"""One request never takes the server down, through real HTTP (conftest's in-process
server, tp=1): each bad body an adversarial user sent (an integer of 5000 digits, a key
that is a lone surrogate, a top_p that is 0 in float32 among them) is a 400 in
OpenAI's shape naming its field, answered before anything reaches the engine, while a stream runs on and
ends with its normal text; a temperature below 1e-5 is greedy (server and `tpkit
generate`); a request the engine fails on gets a 500 (or an error event) alone, the
others go on; a wildcard address keeps a Host allowlist and a browser's cross-origin
POST is refused unless its origin is allowed (`--allow-origin`).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import openai
import pytest

from helpers import generate_args
from tpkit.commands import generate as generate_cmd
from tpkit.mesh import ParallelMesh
from tpkit.serve import openai_api as api
from tpkit.serve import output as output_module
from tpkit.serve.http import App, make_server
from tpkit.weights.sources import open_source

CHAT = [{"role": "user", "content": "Tensor parallelism"}]
BAD = [  # (path, body: dict or raw bytes, param, words of the message)
    ("completions", {"prompt": "x", "seed": 1 << 64}, "seed", "must be a 64-bit integer"),
    ("completions", {"prompt": "\ud800"}, "prompt", "lone surrogate"),
    ("completions", {"prompt": "x", "stream": True, "stream_options": "x"},
     "stream_options", "must be an object"),
    ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens", "must be an integer"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream", "must be true or false"),
    ("completions", {"prompt": "x", "temperature": "0.5"}, "temperature", "must be a number"),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature", "in [0, 100]"),
    ("completions", {"prompt": [5, 7, True]}, "prompt", "list of token ids"),
    ("completions", {"prompt": ["a"] * 33}, "prompt", "at most 32 per request"),
    ("completions", {"prompt": "x", "stop": ["a", ""]}, "stop", "non-empty strings"),
    ("completions", {"prompt": "x", "nope": 1}, "nope", "unsupported parameters: nope"),
    ("completions", b"[" * 100_000, None, "deeper than 16 levels"),
    ("completions", b'{"prompt": "x", "temperature": NaN}', None, "NaN is not a JSON"),
    ("completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens",
     "an integer of 5000 digits"),  # more than int() reads: no 500
    ("completions", b'{"prompt": [5, 7, -' + b"9" * 5000 + b"]}", "prompt[2]",
     "an integer of 5000 digits"),
    ("completions", {"prompt": "x", "\ud800": 1}, "\\ud800", "a key must be text"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "\udc00": 1}]},
     "messages[0].\\udc00", "a key must be text"),
    ("completions", {"prompt": "x", "temperature": 1, "top_p": 1e-46}, "top_p",
     "at least 1.4e-45"),  # 0 in float32: every token would be dropped
    ("chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]},
     "messages[0].content", "lone surrogate"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content",
     "is required"),
    ("chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs",
     "must be true or false"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "in [0, 20]"),
]


@pytest.fixture(scope="module")
def server(openai_server):
    """(base URL, OpenAI client, engine) of conftest's in-process server."""
    return openai_server


def post(port: int, path: str, body, headers: dict | None = None, method: str = "POST"):
    """(status, JSON answer, headers) of a raw request (json.dumps escapes a surrogate)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, body=data if method == "POST" else None, headers={
        "Host": f"127.0.0.1:{port}", "Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else None, resp


def text_of(client, **kw) -> str:
    return client.completions.create(model="llama", prompt="Tensor", **kw).choices[0].text


def stream_into(client, out: list, **kw) -> threading.Thread:
    """A streamed completion in a thread; `out` gets its text pieces, then an exception
    if the stream failed."""
    def run():
        try:
            for c in client.completions.create(model="llama", prompt="Tensor", stream=True,
                                               **kw):
                out.append(c.choices[0].text)
        except Exception as e:  # noqa: BLE001 - what the client saw is the result
            out.append(e)
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while not out and time.monotonic() < deadline:  # streaming
        time.sleep(0.01)
    return t


def test_bad_bodies_are_400s_naming_the_field_and_nothing_runs_for_them(server):
    url, client, engine = server
    port, kw = int(url.rsplit(":", 1)[1]), dict(max_tokens=100, temperature=0,
                                                extra_body={"ignore_eos": True})
    out: list = []
    thread = stream_into(client, out, **kw)
    submitted = engine._ids  # the stream's, once it streams
    for path, body, param, words in BAD:
        status, got, _ = post(port, f"/v1/{path}", body)
        assert status == 400, (body, got)
        err = got["error"]
        assert err["type"] == "invalid_request_error" and words in err["message"], (body, err)
        assert err["param"] == param, (body, err)
    assert engine._ids == submitted  # none of them reached the engine
    thread.join(timeout=120)
    assert "".join(out) == text_of(client, **kw)  # the stream ended with its normal text
    assert engine.looping and engine.accepting  # the server answers on


def test_a_temperature_below_1e5_is_greedy_in_the_server_and_in_generate(server, folder):
    _, client, _ = server
    greedy = text_of(client, max_tokens=12, temperature=0)
    assert text_of(client, max_tokens=12, temperature=1e-300, seed=3) == greedy
    args = generate_args("--checkpoint", str(folder), "--prompt", "Tensor", "--max-new-tokens",
                         "12", "--temperature", "1e-300", "--max-batch", "4", "--batch-invariant", "--decode-chunk", "8")
    generate_cmd._check_args(args)  # accepted: greedy, as the server takes it
    result = generate_cmd._lead(ParallelMesh.single(), args, open_source(folder))
    assert result["texts"] == ["Tensor" + greedy]


@pytest.fixture(scope="module")
def folder(chat_llama):
    return chat_llama


def test_a_request_the_engine_fails_on_fails_alone(server, monkeypatch):
    """A seed torch cannot take (2^64: "Overflow when unpacking long long", which used
    to end the server) put on one request after the edge checked it, as a bug would,
    and a sampler that fails for another (at temperature 0.4321): each gets a 500
    (streamed: an error event), the stream beside them ends with its normal text, the
    next request is answered."""
    _, client, engine = server
    kw = dict(max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    alone, errors = text_of(client, **kw), engine.metrics.requests["error"]
    submit = engine.submit

    def unchecked(ids, params, *group):
        if params.seed == 4321:
            object.__setattr__(params, "seed", 1 << 64)  # past SamplingParams' check
        return submit(ids, params, *group)

    monkeypatch.setattr(engine, "submit", unchecked)
    sample = output_module.sample

    def failing(logits, temperature, *args):
        if temperature == 0.4321:
            raise FloatingPointError("probability tensor contains inf or nan")
        return sample(logits, temperature, *args)

    monkeypatch.setattr(output_module, "sample", failing)
    out: list = []
    thread = stream_into(client, out, **kw)
    with pytest.raises(openai.InternalServerError, match="Overflow") as e:
        text_of(client, max_tokens=4, temperature=0.7, seed=4321)
    assert e.value.status_code == 500 and e.value.body["type"] == "internal_error"
    with pytest.raises(openai.APIError, match="Overflow"):
        list(client.completions.create(model="llama", prompt="x", stream=True, seed=4321,
                                       temperature=0.7, max_tokens=4))
    with pytest.raises(openai.InternalServerError, match="inf or nan"):
        text_of(client, max_tokens=4, temperature=0.4321)
    thread.join(timeout=120)
    assert "".join(out) == alone
    assert engine.metrics.requests["error"] == errors + 3
    assert text_of(client, **kw) == alone


def test_an_error_while_writing_an_answer_is_that_request_s_500(server, monkeypatch):
    """A bug met while writing one answer (its log-probabilities, here): a 500 in
    OpenAI's shape, or mid-stream an error event, and its generation cancelled; the
    next request is answered."""
    _, client, engine = server

    def broken(*args, **kw):
        raise RuntimeError("a bug in writing log-probabilities")

    monkeypatch.setattr(api, "logprobs_block", broken)
    kw = dict(model="llama", prompt="Tensor", max_tokens=40, logprobs=1,
              extra_body={"ignore_eos": True})
    with pytest.raises(openai.InternalServerError, match="a bug in writing") as e:
        client.completions.create(**kw)
    assert e.value.body["type"] == "internal_error"
    with pytest.raises(openai.APIError, match="a bug in writing"):
        list(client.completions.create(stream=True, **kw))
    monkeypatch.undo()
    deadline = time.monotonic() + 30
    while engine.busy and time.monotonic() < deadline:  # the stream's slot is freed
        time.sleep(0.05)
    assert not engine.busy and text_of(client, max_tokens=4, temperature=0)


def test_wildcard_host_keeps_an_allowlist_and_browsers_need_an_allowed_origin(server):
    _, _, engine = server
    httpd = make_server(App(engine, "llama", engine.tokenizer, timeout=10.0), "0.0.0.0", 0,
                        allowed_hosts=["llm.lan"], allowed_origins=["http://ui.lan:3000"])
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port, body = httpd.server_address[1], {"prompt": "Tensor", "max_tokens": 2}
    ui = {"Origin": "http://ui.lan:3000"}
    try:
        for host, status in (("evil.example", 403), (f"evil.example:{port}", 403),
                             (socket.gethostname(), 200), (f"llm.lan:{port}", 200),
                             ("localhost", 200)):
            got = post(port, "/v1/models", None, {"Host": host}, method="GET")
            assert got[0] == status, (host, got[1])
            if status == 403:  # DNS rebinding: the page's own name
                assert got[1]["error"]["message"].startswith("forbidden host 'evil.example")
        for headers, status in (({}, 200), ({"Origin": f"http://127.0.0.1:{port}"}, 200),
                                ({"Origin": "http://evil.example"}, 403),
                                ({"Content-Type": "text/plain"}, 415),
                                ({"Content-Type": "text/plain", **ui}, 200), (ui, 200)):
            status_, got, resp = post(port, "/v1/completions", body, headers)
            assert status_ == status, (headers, got)
            if status != 200:
                assert got["error"]["type"] == "invalid_request_error", got
            allowed = resp.getheader("Access-Control-Allow-Origin")
            assert allowed == (ui["Origin"] if headers.get("Origin") == ui["Origin"] else None)
        status, _, resp = post(port, "/v1/completions", None, ui, method="OPTIONS")
        assert status == 204 and "POST" in resp.getheader("Access-Control-Allow-Methods")
        assert post(port, "/v1/completions", None, {"Origin": "http://evil.example"},
                    method="OPTIONS")[0] == 403
    finally:
        httpd.shutdown()
        httpd.server_close()
