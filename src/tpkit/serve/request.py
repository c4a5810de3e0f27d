"""`Request`: one submitted prompt as its caller sees it — a handle whose tokens arrive
as the engine produces them.

    req = engine.submit([5, 17, 200], SamplingParams(max_tokens=8))   # a loop runs it
    for token in req:              # token ids as they come (waits: it never steps)
        ...
    req.tokens, req.text, req.finish_reason, req.usage

Nothing here steps the engine: a serving loop (`tpkit.serve.loop`) or
`Engine.generate` does. The engine runs its own object beside the handle
(`serve.sequence.Seq`: blocks, slot, generator, ...) and writes the handle only through
`push`, `finish` and `fail`; the caller's threads `cancel`, `attach`, iterate and read.
Events go from the engine's thread to the caller's through a queue: `Token` (its id
and the text now safe to show; id None: text held back until the end), then `Done`
(finish reason "stop", "length" or "cancelled") or `Failed` (status and message) when
the server could not finish it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tpkit.serve.params import SamplingParams


@dataclass(frozen=True)
class Token:
    """A generated token (`token` None: text held back until the end) and its new text."""

    token: int | None
    text: str


@dataclass(frozen=True)
class Done:
    """The end: why it stopped ("stop", "length", "cancelled")."""

    reason: str


@dataclass(frozen=True)
class Failed:
    """The server could not finish it: an HTTP status and a message."""

    status: int
    message: str


Event = Token | Done | Failed


class RequestFailed(RuntimeError):
    """The server could not finish a request (a worker died, it is shutting down)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Request:
    """A prompt being generated, as its caller sees it: its events, and its output (tokens,
    log-probabilities, text, finish reason, timings) as the engine pushes it."""

    def __init__(self, rid: int, prompt: list[int], params: SamplingParams) -> None:
        self.id, self.prompt, self.params = rid, prompt, params
        self.on_event = None  # `attach`: called with each event instead of the queue
        self.tokens: list[int] = []
        self.logprobs: list[float] = []  # of each chosen token under the model (no temperature)
        self.top: list[list[tuple[int, float]]] = []  # the k likeliest, if params.logprobs
        self.prompt_logprobs: list[float | None] = []  # with echo: None, then each prompt
        self.prompt_top: list[list[tuple[int, float]] | None] = []  # token's after the ones before
        self.text = ""
        self.finish_reason: str | None = None
        self.error: RequestFailed | None = None
        self.cached_tokens = 0  # of its prompt, given by the prefix cache (at the end)
        self.arrived, self.first_at, self.last_at = time.perf_counter(), None, None
        self.prev_at: float | None = None  # the token before the last one's time
        self.events: queue.Queue = queue.Queue()
        self._cancel, self._emit_lock = threading.Event(), threading.Lock()
        self._ended = False

    # -- caller side -------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop generating (the client went away): the slot is freed at the next step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        """Was `cancel` called?"""
        return self._cancel.is_set()

    def events_iter(self) -> Iterator[Event]:
        """Every event until the last (`Done` or `Failed`); waits for the engine's thread."""
        while not self._ended:
            ev = self.events.get()
            if not isinstance(ev, Token):
                self._ended = True  # the last event: iterating again returns at once
            yield ev

    def __iter__(self) -> Iterator[int]:
        """Token ids as they are generated; raises `RequestFailed` if the server fails."""
        for ev in self.events_iter():
            if isinstance(ev, Token) and ev.token is not None:  # None: held-back text
                yield ev.token
            elif isinstance(ev, Failed):
                raise RequestFailed(ev.status, ev.message)

    def result(self) -> Request:
        """Wait for the end (see `__iter__`); returns this request. Once it is done (as
        after `Engine.generate`) it returns at once; a failure raises `RequestFailed`."""
        if self.error is not None:
            raise self.error
        if self.finish_reason is None:
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
             top: list[tuple[int, float]] | None = None, prompt: tuple | None = None) -> None:
        """A new token, its log-probability (and the likeliest tokens' when asked), and
        the text it makes safe to show; `prompt`: the prompt's scores (log-probabilities,
        likeliest), when they were (re)computed since the last token."""
        now = time.perf_counter()
        if prompt is not None:
            self.prompt_logprobs, self.prompt_top = prompt
        self.first_at = self.first_at or now
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top.append(top)
        self.text += shown
        self.prev_at, self.last_at = self.last_at, now
        self._emit(Token(token, shown))

    def finish(self, reason: str, tail: str = "", cached_tokens: int = 0) -> None:
        """The end: the text still held back, then the finish reason (and the prompt's
        tokens the prefix cache gave)."""
        self.cached_tokens = cached_tokens
        if tail:
            self.text += tail
            self._emit(Token(None, tail))
        self.finish_reason = reason
        self._emit(Done(reason))

    def fail(self, status: int, message: str) -> None:
        """The server cannot finish it."""
        self.error = RequestFailed(status, message)
        self._emit(Failed(status, message))

    def attach(self, listener) -> None:
        """Have `listener(event)` called with every event, from the engine's thread,
        instead of queueing them (the ones queued already first, in order)."""
        with self._emit_lock:
            while not self.events.empty():
                listener(self.events.get_nowait())
            self.on_event = listener

    def _emit(self, ev: Event) -> None:
        with self._emit_lock:
            if self.on_event is None:
                self.events.put(ev)
            else:
                self.on_event(ev)
