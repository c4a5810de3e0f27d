"""`Request`: one submitted prompt as its caller sees it — a handle whose tokens arrive
as the engine produces them.

    req = engine.submit([5, 17, 200], SamplingParams(max_tokens=8))
    for token in req:              # token ids as they come (steps the engine if no loop runs)
        ...
    req.tokens, req.text, req.finish_reason, req.usage

Events go from the engine's thread to the caller's through a queue: ("token", id,
text now safe to show), then ("done", finish_reason) — "stop", "length" or
"cancelled" — or ("error", status, message) when the server could not finish it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from tpkit.serve.params import SamplingParams


class Stepper(Protocol):
    """What a request needs of its engine: whether a loop runs it, else how to step it."""

    looping: bool

    def step(self) -> bool: ...


class RequestFailed(RuntimeError):
    """The server could not finish a request (a worker died, it is shutting down)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Request:
    """A prompt being generated: its tokens, text, finish reason and timings."""

    def __init__(self, engine: Stepper, rid: int, prompt: list[int], params: SamplingParams
                 ) -> None:
        self.engine, self.id, self.prompt, self.params = engine, rid, prompt, params
        self.tokens: list[int] = []
        self.logprobs: list[float] = []  # of each chosen token under the model (no temperature)
        self.top: list[list[tuple[int, float]]] = []  # the k likeliest, if params.logprobs
        self.prompt_logprobs: list[float | None] = []  # with echo: None, then each prompt
        self.prompt_top: list[list[tuple[int, float]] | None] = []  # token's after the ones before
        self.text = ""
        self.finish_reason: str | None = None
        self.error: RequestFailed | None = None
        self.slot: int | None = None
        self.arrived, self.first_at, self.last_at = time.perf_counter(), None, None
        self.events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._ended = False

    # -- caller side -------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop generating (the client went away): the slot is freed at the next step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        """Was `cancel` called?"""
        return self._cancel.is_set()

    def events_iter(self) -> Iterator[tuple]:
        """Every event until the last ("done" or "error"); steps the engine itself when
        no serving loop runs it."""
        while not self._ended:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                if self.engine.looping:
                    ev = self.events.get()
                else:
                    self.engine.step()
                    continue
            if ev[0] != "token":
                self._ended = True  # the last event: iterating again returns at once
            yield ev

    def __iter__(self) -> Iterator[int]:
        """Token ids as they are generated; raises `RequestFailed` if the server fails."""
        for ev in self.events_iter():
            if ev[0] == "token" and ev[1] is not None:  # None: held-back text at the end
                yield ev[1]
            elif ev[0] == "error":
                raise RequestFailed(ev[1], ev[2])

    def result(self) -> Request:
        """Wait for the end (see `__iter__`); returns this request."""
        for _ in self:
            pass
        return self

    @property
    def usage(self) -> dict:
        """OpenAI's usage counts."""
        return dict(prompt_tokens=len(self.prompt), completion_tokens=len(self.tokens),
                    total_tokens=len(self.prompt) + len(self.tokens))

    @property
    def done(self) -> bool:
        """Finished, cancelled or failed."""
        return self.finish_reason is not None or self.error is not None

    # -- engine side -------------------------------------------------------------------
    def push(self, token: int, logprob: float, shown: str,
             top: list[tuple[int, float]] | None = None) -> None:
        """A new token, its log-probability (and the likeliest tokens' when asked), and
        the text it makes safe to show."""
        now = time.perf_counter()
        self.first_at = self.first_at or now
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top.append(top)
        self.text += shown
        self.last_at = now
        self.events.put(("token", token, shown))

    def finish(self, reason: str, tail: str = "") -> None:
        """The end: the text still held back, then the finish reason."""
        if tail:
            self.text += tail
            self.events.put(("token", None, tail))
        self.finish_reason = reason
        self.events.put(("done", reason))

    def fail(self, status: int, message: str) -> None:
        """The server cannot finish it."""
        self.error = RequestFailed(status, message)
        self.events.put(("error", status, message))
