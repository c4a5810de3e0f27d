"""Requests that must not harm others, through the HTTP API of conftest's in-process
server (`openai_server`, 4 places):

- a text prompt too long for the context whatever its tokens is refused (400) before it
  is tokenized, and prompts are tokenized without the lock the engine's detokenizer
  takes (12 prompts of 1 MB stalled a running stream for seconds);
- a short request sent while one POST's n x prompts wait is admitted at the next free
  place, not after all of them (counted in scheduler steps, never in seconds), and
  answers the text it answers alone.
"""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from tpkit.weights.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def server(openai_server):
    """(base URL, OpenAI client, engine) of conftest's in-process server."""
    return openai_server


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_a_huge_prompt_is_refused_untokenized_and_tokenizing_takes_no_engine_lock(
        server, monkeypatch):
    url, _, engine = server
    seen: list[int] = []  # the length of each text tokenized
    real = HFTokenizer.encode
    monkeypatch.setattr(HFTokenizer, "encode", lambda self, text, special=True: (
        seen.append(len(text)), real(self, text, special))[1])
    huge = "Tensor parallelism splits the weight " * 28_000  # 1 MB, under the body limit
    status, body = post(url, {"model": "llama", "prompt": huge, "max_tokens": 4})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert f"({len(huge)} bytes: at least" in body["error"]["message"], body
    assert seen == [], seen  # never tokenized (it was, under the detokenizer's lock)
    # more tokens than the context, in few bytes: tokenized, then refused, while the
    # engine's detokenizer holds its lock (it waited for the lock)
    many = "a " * engine.max_len
    with engine.tokenizer_lock:
        status, body = post(url, {"model": "llama", "prompt": many, "max_tokens": 4},
                            timeout=30)
    assert status == 400 and "tokens) + max_tokens (4)" in body["error"]["message"], body
    assert seen == [len(many)], seen


def test_a_short_request_is_admitted_at_the_next_free_place_behind_n_x_prompts(
        server, monkeypatch):
    url, client, engine = server
    short = dict(model="llama", prompt="layer 7", max_tokens=5, temperature=0)
    alone = client.completions.create(**short).choices[0].text
    steps: list = []  # per scheduler step: the ids admitted; ("submit", id) in between
    schedule, submit = engine.scheduler.schedule, engine.submit
    monkeypatch.setattr(engine.scheduler, "schedule", lambda *a: (
        out := schedule(*a), steps.append([r.id for r in out.admitted]))[0])
    monkeypatch.setattr(engine, "submit", lambda *a: (
        req := submit(*a), steps.append(("submit", req.id)))[0])
    started, ended = threading.Event(), []

    def big() -> None:  # 8 prompts x n=4: 32 requests of 32 tokens on 4 places
        for _ in client.completions.create(
                model="llama", prompt=["Tensor", "pipeline", "all-reduce", "column",
                                       "devices", "stage 3", "fc1", "layer"],
                n=4, max_tokens=32, temperature=0, stream=True,
                extra_body={"ignore_eos": True}):
            started.set()
        ended.append(True)

    t = threading.Thread(target=big)
    t.start()
    assert started.wait(60)
    r = client.completions.create(**short)
    t.join(timeout=120)
    assert ended and r.choices[0].text == alone
    me = int(r.id.split("-")[1])
    sent = steps.index(("submit", me))
    admitted = next(i for i, s in enumerate(steps) if isinstance(s, list) and me in s)
    between = [s for s in steps[sent:admitted] if isinstance(s, list)]
    later = [i for s in steps[sent:] if isinstance(s, list) for i in s if i != me]
    assert later, "the big request was all admitted before the short one came"
    assert sum(map(len, between)) == 0, between  # none of the 32 went ahead of it
    assert len(between) <= 32 + 1, len(between)  # a place frees within 32 tokens
