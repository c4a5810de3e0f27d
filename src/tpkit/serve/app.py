"""What the HTTP routes serve (`tpkit.serve.http`): the engine, the model's name, the
tokenizer and the limits, with the two steps of a POST that are not HTTP: its body to a
validated request and prompt ids (`parse`), and their submission (`submit`, the
engine's refusals as OpenAI's errors).
"""

from __future__ import annotations

import threading
import time

from tpkit.serve import openai_api as api
from tpkit.serve import protocol
from tpkit.serve.engine import Engine, TooLong
from tpkit.serve.openai_api import MAX_BODY
from tpkit.serve.request import Request, RequestFailed
from tpkit.spec.errors import UserError


class App:
    """What the routes serve: the engine, the model's name, the tokenizer, the limits."""

    def __init__(self, engine: Engine, model_name: str, tokenizer, *, max_body: int = MAX_BODY,
                 timeout: float = 30.0) -> None:
        self.engine, self.name, self.tokenizer = engine, model_name, tokenizer
        self.max_body, self.timeout, self.created = max_body, timeout, int(time.time())
        self.active, self._active = 0, threading.Condition()  # POSTs being answered

    def enter(self) -> None:
        """A POST starts being answered."""
        with self._active:
            self.active += 1

    def leave(self) -> None:
        """... and is done."""
        with self._active:
            self.active -= 1
            self._active.notify_all()

    def wait_handlers(self, timeout: float) -> bool:
        """Wait until no POST is being answered (True) or `timeout` seconds."""
        with self._active:
            return self._active.wait_for(lambda: self.active == 0, timeout)

    def parse(self, raw: bytes, chat: bool
              ) -> tuple[protocol.CompletionRequest | protocol.ChatRequest, list[list[int]]]:
        """(the request, the ids of each of its prompts) of a POST body; ApiError for a
        bad one."""
        body = protocol.parse_json(raw)
        req = protocol.validate(body, chat)
        if req.model not in (None, self.name):
            raise api.ApiError(404, f"model {req.model!r} is not served here "
                                    f"(GET /v1/models: {self.name!r})", "model")
        lock = self.engine.tokenizer_lock
        if chat:
            return req, [api.chat_ids(body, self.tokenizer, lock)]
        return req, [api.prompt_ids(p, self.tokenizer, lock) for p in req.prompt]

    def submit(self, ids: list[int], params, on_event=None) -> Request:
        """Engine.submit with its errors as ApiErrors (413 too long, 400, 503); its events
        go to `on_event` (`Request.attach`)."""
        try:
            req = self.engine.submit(ids, params)
            if on_event is not None:
                req.attach(on_event)
            return req
        except TooLong as e:
            raise api.ApiError(413, str(e), "max_tokens") from None
        except UserError as e:
            raise api.ApiError(400, str(e)) from None
        except RequestFailed as e:
            raise api.ApiError(e.status, str(e)) from None
