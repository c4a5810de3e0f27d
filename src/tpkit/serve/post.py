"""The one answer of every POST route of `tpkit.serve.http` (completions, chat,
responses, embeddings): `answer`, its skeleton, is the same for each; only the body's
shape differs (`_whole`, `embeddings.answer`, the streams). Its steps:

    refused where this model does not serve the route (400)
    enter (the drain counts it)     -> its body read (411, 413: the connection closed)
    parsed and submitted in one call (`App.post`, a thread of the pool) -> ApiError: 4xx
    its events handed from the engine's thread to this coroutine (thread-safe)
    streamed (`_closing`: whatever ends it, no generation left running), or
    awaited, the client watched (gone: 499, its work cancelled) and answered whole
    a bug met on the way: this request's 500 alone; leave
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys

from fastapi import Request as HttpRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from tpkit.host.web import Guard
from tpkit.serve import answers
from tpkit.serve import embeddings as embed_route
from tpkit.serve import openai_api as api
from tpkit.serve import responses as answer_of
from tpkit.serve.app import EMBEDDINGS, RESPONSES, App, Posted
from tpkit.serve.request import Done, Failed, Request, Token


def _encode(body: dict) -> bytes:
    """JSON bytes; a lone surrogate (an unknown field's name) as its JSON escape."""
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")


def _sse(payload: dict) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


class Answers:
    """The responses every route writes, with the CORS headers of an allowed origin."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def cors(self, request: HttpRequest) -> dict[str, str]:
        """Access-Control-Allow-Origin for a browser page of an allowed origin (else none)."""
        origin = request.headers.get("Origin") or ""
        if not origin or not self.guard.origin_allowed(origin):
            return {}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def error(self, request: HttpRequest, e: api.ApiError, close: bool = False) -> Response:
        """OpenAI's error JSON (`close`: the connection too, its body unread)."""
        headers = {**self.cors(request), **({"Connection": "close"} if close else {})}
        return Response(_encode(e.body()), e.status, headers, "application/json")

    def ok(self, request: HttpRequest, body: dict, status: int = 200) -> Response:
        """A JSON answer."""
        return Response(_encode(body), status, self.cors(request), "application/json")

    def events(self, request: HttpRequest, events) -> StreamingResponse:
        """Server-sent events."""
        return StreamingResponse(events, 200, {**self.cors(request), "Cache-Control":
                                               "no-store"}, "text/event-stream; charset=utf-8")


async def _body(app: App, request: HttpRequest) -> bytes:
    size = request.headers.get("Content-Length", "")
    if not size.isascii() or not size.isdigit():
        raise api.ApiError(411, "a Content-Length header is needed")
    if int(size) > app.max_body:
        raise api.ApiError(413, f"body of {size} bytes; at most {app.max_body}")
    return await request.body()


def _failed(req: Request | None, e: Exception) -> api.ApiError:
    """An unexpected error while answering: one line on stderr, its generation cancelled."""
    if req is not None:
        req.cancel()
    why = f"the server failed on this request ({type(e).__name__}: {e})"
    print(f"tpkit serve: error: {why}", file=sys.stderr, flush=True)
    return api.ApiError(500, why)


async def answer(app: App, out: Answers, request: HttpRequest, kind: str) -> Response:
    """The one answer of every POST route (`kind`): refused where this model does not
    serve it; its body read (411, 413: the connection closed unread); parsed and
    submitted in one call (`App.post`, in a thread: tokenizing may take long), its
    events handed from the engine's thread to this coroutine; then streamed, or awaited
    (a client gone: 499, its work cancelled) and answered whole. A bug met on the way:
    that request's 500 alone."""
    if (refusal := app.not_served(kind == EMBEDDINGS)) is not None:
        return out.error(request, refusal)  # an encoder's server, or a decoder's
    app.enter()
    streaming, posted, gone = False, None, None
    try:
        try:
            raw = await _body(app, request)
        except api.ApiError as e:
            return out.error(request, e, close=e.status == 413)  # the body is not read
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def put(index: int, ev) -> None:  # the engine's thread -> this request's coroutine
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, ev))
            except RuntimeError:
                pass  # the event loop has ended (the server stopped)

        try:
            posted = await run_in_threadpool(app.post, kind, raw, put)
        except api.ApiError as e:
            return out.error(request, e)
        if posted.stream:
            streaming = True
            return out.events(request, _closing(app, posted.handles,
                                                _streamed(app, posted, events)))
        gone = _hung_up(request)
        body = await _wait(posted, events, gone)
        if body is None:  # every handle done
            body = embed_route.answer(app, posted) if kind == EMBEDDINGS else \
                _whole(app, posted)
        if isinstance(body, api.ApiError):
            return out.error(request, body)
        return out.ok(request, body) if isinstance(body, dict) else body
    except Exception as e:  # noqa: BLE001 - this request fails alone; the server goes on
        if posted is not None:
            posted.cancel()
        return out.error(request, _failed(None, e), close=True)
    finally:
        if gone is not None:
            gone.cancel()
        if not streaming:
            app.leave()


async def _wait(posted: Posted, events: asyncio.Queue, gone: asyncio.Future
                ) -> Response | api.ApiError | None:
    """Until every handle of `posted` is done (None); a failure's error or, the client
    gone (checked at every event: tokens may never pause for long), a 499, its work
    cancelled."""
    left = len(posted.handles)
    while left:
        if gone.done():
            posted.cancel()
            return Response(status_code=499)
        try:
            _, ev = await asyncio.wait_for(events.get(), 0.2)
        except TimeoutError:
            continue
        if isinstance(ev, Failed):
            posted.cancel()
            return api.ApiError(ev.status, ev.message)
        left -= isinstance(ev, Done)
    return None


def _usage(app: App, posted: Posted):
    return app.usage(posted.prompts, posted.asked.n or 1)


def _rid(posted: Posted) -> str:
    return f"{'chatcmpl' if posted.chat else 'cmpl'}-{posted.handles[0].id}"


def _whole(app: App, posted: Posted) -> dict:
    """The body of a generated answer, whole (the Responses API's shape for its route)."""
    reqs, asked, chat = posted.handles, posted.asked, posted.chat
    body = api.completion(_rid(posted), app.answering(asked), "", None,
                          _usage(app, posted)(reqs), chat, app.created,
                          fingerprint=app.fingerprint)
    body["choices"] = [answers.choice(app, r, chat, i) for i, r in enumerate(reqs)]
    if chat and asked.offered:  # a call or text: the answer's whole text says
        for ch, r in zip(body["choices"], reqs):
            ch["message"], ch["finish_reason"] = app.tool_answer(asked, r.text,
                                                                 ch["finish_reason"])
    return answer_of.whole(app, str(reqs[0].id), body) if posted.kind == RESPONSES else body


def _streamed(app: App, posted: Posted, events: asyncio.Queue):
    """The server-sent events of a streamed answer, in its route's shape."""
    reqs, asked, usage = posted.handles, posted.asked, _usage(app, posted)
    if posted.kind == RESPONSES:
        return answer_of.stream(app, reqs[0], events, str(reqs[0].id), asked, usage)
    return _stream(app, app.answering(asked), reqs, events, _rid(posted), posted.chat,
                   usage if asked.include_usage else None,
                   asked if posted.chat and asked.offered else None)


def _hung_up(request: HttpRequest) -> asyncio.Future:
    """Done once the client (its body read) hangs up: awaited, since a polled
    `is_disconnected()` never sees it behind the guard's middleware."""
    return asyncio.ensure_future(request.receive())


def _cancel(reqs: list[Request]) -> None:
    for r in reqs:
        r.cancel()


async def _stream(app: App, name: str, reqs: list[Request], events: asyncio.Queue, rid: str,
                  chat: bool, usage, tooled=None):
    """The server-sent events of a streamed answer, its choices interleaved as their
    tokens come (echo: a choice's prompt first); a client gone cancels them. A chat
    that offers tools (`tooled`: its request): `answers.Tooled`."""
    created, left = app.created, len(reqs)
    held = [answers.Tooled(app, tooled) if tooled is not None else None for _ in reqs]
    chunk = functools.partial(api.chunk, fingerprint=app.fingerprint)
    tokens, offsets, started = [0] * len(reqs), [0] * len(reqs), [False] * len(reqs)
    try:
        if chat:  # the assistant's role comes first
            yield _sse(chunk(rid, name, None, None, chat, created, first=True))
        while left:
            c, ev = await events.get()
            req = reqs[c]
            if not started[c] and req.params.echo and not isinstance(ev, Failed):
                text, block = answers.echoed(app, req, chat)
                offsets[c] = sum(map(len, block["tokens"])) if block else 0
                yield _sse(chunk(rid, name, text, None, chat, created, logprobs=block,
                                     index=c))
            started[c] = True
            if isinstance(ev, Token) and tooled is not None:  # a forced call's deltas
                said = held[c].token(chunk(rid, name, None, None, chat, created, index=c),
                                     ev.text)
                if said is not None:
                    yield _sse(said)
                continue
            if isinstance(ev, Token):  # one chunk per token (its text may be held back)
                block = None
                if ev.token is not None:  # a token (None: text held back until the end)
                    i = tokens[c]
                    block = answers.token_logprobs(app, req, chat, i, i + 1, offsets[c])
                    offsets[c] += len("".join((block or {}).get("tokens", ())))
                    tokens[c] += 1
                yield _sse(chunk(rid, name, ev.text, None, chat, created, logprobs=block,
                                     index=c))
            elif isinstance(ev, Done):
                left -= 1
                reason = ev.reason
                if tooled is not None:
                    said, reason = held[c].end(chunk(rid, name, None, None, chat, created,
                                                     index=c), req.text, reason)
                    if said is not None:
                        yield _sse(said)
                yield _sse(chunk(rid, name, None, reason, chat, created, index=c))
            else:
                left = 0
                _cancel(reqs)
                yield _sse(api.ApiError(ev.status, ev.message).body())
        if usage is not None and all(r.finish_reason for r in reqs):
            yield _sse(api.usage_chunk(rid, name, usage(reqs), chat, created, app.fingerprint))
        yield b"data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - a bug met writing this answer: its error event
        _cancel(reqs)
        yield _sse(_failed(None, e).body())
        yield b"data: [DONE]\n\n"


async def _closing(app: App, reqs: list[Request], events):
    """A stream of events that, however it ends (the client gone, a bug), leaves no
    generation running (their blocks are freed at the next step) and the POST done."""
    try:
        async for e in events:
            yield e
    except Exception as e:  # noqa: BLE001 - a bug met writing this answer: its error event
        yield _sse(_failed(None, e).body())
    finally:
        _cancel([r for r in reqs if not r.done])
        app.leave()
