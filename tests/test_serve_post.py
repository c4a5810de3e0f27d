"""Every POST route is one skeleton over `App.post`, which parses a body and submits it
in one call: what it submits is what the HTTP route answers (the same greedy text), a
refused body leaves nothing running, and a route the model does not serve is refused
before anything is read. On the session's in-process server (`openai_server`)."""

from __future__ import annotations

import json
import time

import pytest

from tpkit.serve.app import CHAT, COMPLETIONS, App
from tpkit.serve.openai_api import ApiError
from tpkit.serve.request import Done


def _done(posted, events: list, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(isinstance(ev, Done) for _, ev in events) < len(posted.handles):
        assert time.monotonic() < deadline, events
        time.sleep(0.01)


def test_app_post_parses_and_submits_what_the_route_answers(openai_server):
    _, client, engine = openai_server
    app = App(engine, "llama", engine.tokenizer)
    body = {"model": "llama", "prompt": ["Tensor", "A"], "max_tokens": 5, "temperature": 0,
            "n": 2}
    events: list = []
    posted = app.post(COMPLETIONS, json.dumps(body).encode(), lambda *ev: events.append(ev))
    assert len(posted.handles) == 4 and not posted.stream and not posted.chat
    _done(posted, events)
    served = client.completions.create(**body)
    assert [r.text for r in posted.handles] == [c.text for c in served.choices]
    assert {i for i, _ in events} == {0, 1, 2, 3}  # each choice's events, by its index

    with pytest.raises(ApiError) as bad:  # refused whole: nothing of it runs
        app.post(CHAT, json.dumps({"messages": [{"role": "user", "content": "x"}],
                                   "max_tokens": 10 ** 6}).encode(), lambda *ev: None)
    assert bad.value.status == 400 and not engine.busy
    assert app.not_served(embeddings=True).status == 400  # a decoder: no /v1/embeddings
