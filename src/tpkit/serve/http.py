"""The OpenAI-compatible HTTP front on FastAPI + uvicorn, a thin layer over the `Engine`
(rank 0 only).

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p",
                                 "top_k", "seed", "stop", "stream", ...}
    POST /v1/chat/completions   {"model", "messages", ...}: the tokenizer's chat template
    POST /v1/embeddings         {"model", "input", "encoding_format"}: an encoder's
                                (`tpkit.serve.embeddings`; the others answer 400 there)
    GET  /v1/models   /health   /metrics (prometheus_client)   /docs (OpenAPI)

`stream: true` answers server-sent events, one OpenAI chunk per `data:` line, ending
with `data: [DONE]`. Errors come in OpenAI's JSON shape: 400 a bad request (every field
checked by the pydantic models of `tpkit.serve.protocol` before anything is submitted),
403 a foreign Host or Origin, 404 an unknown model or path, 411 no Content-Length, 413
a body over `max_body` bytes or a prompt too long for the context, 415 a POST that is
not JSON, 500 a request the server failed on (that request alone: the others and the
server go on), 503 while shutting down or after a worker died.

Hardened as the quiz's server is (`tpkit.host.web.Guard`, which both use): 127.0.0.1
unless told otherwise, the Host header must be one of the server's names whatever the
address (DNS rebinding), a browser's cross-origin POST is refused unless its origin is
allowed (then it gets CORS headers), bodies are size-limited before being read, an idle
connection is closed after `timeout` seconds (uvicorn's keep-alive timeout). A client
that goes away (seen while waiting or streaming) cancels its request, which frees its
blocks at the next step. (The quiz's page stays on the standard library's server: two
routes, no schema, no streaming.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import socket
import sys
import threading
from collections.abc import Iterable

import h11
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from tpkit.host.web import HOST, Guard, bound_socket
from tpkit.serve import answers, protocol
from tpkit.serve import embeddings as embed_route
from tpkit.serve import openai_api as api
from tpkit.serve import responses as answer
from tpkit.serve.app import App
from tpkit.serve.request import Done, Failed, Request, Token


def _encode(body: dict) -> bytes:
    """JSON bytes; a lone surrogate (an unknown field's name) as its JSON escape."""
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")


def _sse(payload: dict) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def _schema(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


def build_api(app: App, guard: Guard) -> FastAPI:
    """The FastAPI application of `app`, behind `guard`."""
    fa = FastAPI(title="tpkit serve", summary="OpenAI-compatible completions",
                 redoc_url=None)

    def cors(request: HttpRequest) -> dict[str, str]:
        origin = request.headers.get("Origin") or ""
        if not origin or not guard.origin_allowed(origin):
            return {}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def error(request: HttpRequest, e: api.ApiError, close: bool = False) -> Response:
        headers = {**cors(request), **({"Connection": "close"} if close else {})}
        return Response(_encode(e.body()), e.status, headers, "application/json")

    def ok(request: HttpRequest, body: dict, status: int = 200) -> Response:
        return Response(_encode(body), status, cors(request), "application/json")

    @fa.middleware("http")
    async def guarded(request: HttpRequest, call_next):
        refusal = guard.refusal(request.method, request.headers)
        if refusal is not None:  # a refused body is not read
            return error(request, api.ApiError(*refusal), close=True)
        if request.method != "OPTIONS" and (unkeyed := app.refusal(
                request.url.path, request.headers.get("Authorization"))) is not None:
            response = error(request, unkeyed, close=True)
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await call_next(request)

    @fa.exception_handler(HTTPException)
    async def no_route(request: HttpRequest, exc: HTTPException):
        return error(request, api.ApiError(404, f"no such path: {request.method} "
                                                f"{request.url.path}"))

    @fa.options("/{path:path}", include_in_schema=False)
    async def preflight(request: HttpRequest, path: str):
        if not cors(request):
            return error(request, api.ApiError(403, "cross-origin requests are refused "
                                                    "(--allow-origin ORIGIN allows one)"))
        return Response(status_code=204, headers={
            **cors(request), "Access-Control-Allow-Methods": "GET, POST",
            "Access-Control-Allow-Headers": "Authorization, Content-Type",
            "Access-Control-Max-Age": "600"})

    @fa.get("/v1/models", summary="the model served")
    async def models(request: HttpRequest):
        return ok(request, app.models())

    @fa.get("/health", summary="200 while serving, else 503 and why (a worker stuck...)")
    async def health(request: HttpRequest):
        why = app.health()
        return ok(request, {"status": "ok"} if why is None else
                  {"status": "unavailable", "reason": why}, 200 if why is None else 503)

    @fa.get("/metrics", summary="Prometheus metrics (prometheus_client)")
    async def metrics(request: HttpRequest):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(app.engine.metrics.render(), 200, cors(request), CONTENT_TYPE_LATEST)

    @fa.post("/v1/completions", summary="a completion (OpenAI's API)",
             openapi_extra=_schema(protocol.CompletionRequest))
    async def completions(request: HttpRequest):
        return await _post(app, request, False, error, ok, cors)

    @fa.post("/v1/chat/completions", summary="a chat completion (OpenAI's API)",
             openapi_extra=_schema(protocol.ChatRequest))
    async def chat_completions(request: HttpRequest):
        return await _post(app, request, True, error, ok, cors)

    @fa.post("/v1/responses", summary="a response (OpenAI's Responses API)")
    async def responses(request: HttpRequest):
        return await _post(app, request, True, error, ok, cors, responses=True)

    @fa.post("/v1/embeddings", summary="embeddings of an encoder model (OpenAI's API)",
             openapi_extra=_schema(protocol.EmbeddingRequest))
    async def embeddings(request: HttpRequest):
        return await embed_route.embeddings(app, request, _body, error, ok, _hung_up)

    return fa


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


def _submit_all(app: App, prompts: list[list[int]], params, n: int, put, chat: bool
                ) -> list[Request]:
    """n choices of each prompt (choice i of prompt p: index p * n + i; a seed s gives
    choice i the seed s ^ i); their events go to put(index, event); they take their turns
    as one (the first one's group). One refused: those submitted are cancelled, the
    ApiError raised."""
    reqs: list[Request] = []
    try:
        for ids in prompts:
            for i in range(n):
                q = params if i == 0 or params.seed is None else \
                    dataclasses.replace(params, seed=params.seed ^ i)
                reqs.append(app.submit(ids, q, functools.partial(put, len(reqs)), chat,
                                       reqs[0].id if reqs else None))
    except api.ApiError:
        _cancel(reqs)
        raise
    return reqs


async def _post(app: App, request: HttpRequest, chat: bool, error, ok, cors,
                responses: bool = False) -> Response:
    if (refusal := app.not_served(embeddings=False)) is not None:
        return error(request, refusal)  # an encoder's server
    app.enter()
    streaming, reqs, gone = False, [], None
    try:
        try:
            raw = await _body(app, request)
        except api.ApiError as e:
            return error(request, e, close=e.status == 413)  # the body is not read
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def put(index: int, ev) -> None:  # the engine's thread -> this request's coroutine
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, ev))
            except RuntimeError:
                pass  # the event loop has ended (the server stopped)

        try:
            asked, prompts = await run_in_threadpool(app.parse, raw, chat, responses)
            reqs = _submit_all(app, prompts, app.sampling(asked), asked.n or 1, put, chat)
        except api.ApiError as e:
            return error(request, e)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{reqs[0].id}"
        usage = app.usage(prompts, asked.n or 1)
        if asked.stream:
            streaming = True
            return StreamingResponse(_closing(app, reqs, answer.stream(
                app, reqs[0], events, str(reqs[0].id), asked, usage) if responses else
                _stream(app, reqs, events, rid, chat, usage if asked.include_usage else None,
                        asked if chat and asked.offered else None)),
                200, {**cors(request), "Cache-Control": "no-store"},
                "text/event-stream; charset=utf-8")
        left, gone = len(reqs), _hung_up(request)
        while left:
            if gone.done():  # checked at every event: tokens may never pause for long
                _cancel(reqs)
                return Response(status_code=499)
            try:
                _, ev = await asyncio.wait_for(events.get(), 0.2)
            except TimeoutError:
                continue
            if isinstance(ev, Failed):
                _cancel(reqs)
                return error(request, api.ApiError(ev.status, ev.message))
            left -= isinstance(ev, Done)
        body = api.completion(rid, app.name, "", None, usage(reqs), chat, app.created,
                              fingerprint=app.fingerprint)
        body["choices"] = [answers.choice(app, r, chat, i) for i, r in enumerate(reqs)]
        if chat and asked.offered:  # a call or text: the answer's whole text says
            for ch, r in zip(body["choices"], reqs):
                ch["message"], ch["finish_reason"] = app.tool_answer(asked, r.text,
                                                                     ch["finish_reason"])
        return ok(request, answer.whole(app, str(reqs[0].id), body) if responses else body)
    except Exception as e:  # noqa: BLE001 - this request fails alone; the server goes on
        _cancel(reqs)
        return error(request, _failed(None, e), close=True)
    finally:
        if gone is not None:
            gone.cancel()
        if not streaming:
            app.leave()


def _hung_up(request: HttpRequest) -> asyncio.Future:
    """Done once the client (its body read) hangs up: awaited, since a polled
    `is_disconnected()` never sees it behind the guard's middleware."""
    return asyncio.ensure_future(request.receive())


def _cancel(reqs: list[Request]) -> None:
    for r in reqs:
        r.cancel()


async def _stream(app: App, reqs: list[Request], events: asyncio.Queue, rid: str,
                  chat: bool, usage, tooled=None):
    """The server-sent events of a streamed answer, its choices interleaved as their
    tokens come (echo: a choice's prompt first); a client gone cancels them. A chat
    that offers tools (`tooled`: its request): `answers.Tooled`."""
    name, created, left = app.name, app.created, len(reqs)
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


class _Timed(H11Protocol):
    """uvicorn's h11 protocol, which also closes a connection silent for `timeout`
    seconds before its request is whole (uvicorn times only the wait between requests;
    the standard library's server timed every read)."""

    def connection_made(self, transport) -> None:  # noqa: D102
        super().connection_made(transport)
        self._silence()

    def data_received(self, data: bytes) -> None:  # noqa: D102
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and \
                not self.transport.is_closing():
            self._silence()  # still reading its request: the timer starts again

    def _silence(self) -> None:
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)


class Server:
    """uvicorn serving an `App` on a bound socket, run in a thread: `serve_forever()`,
    `shutdown()` (from another thread: stop, let the answers being written finish for
    2 s), `server_close()`; `server_address` as the standard library's servers."""

    def __init__(self, api_app: FastAPI, sock: socket.socket, timeout: float) -> None:
        self.socket, self.server_address = sock, sock.getsockname()
        config = uvicorn.Config(api_app, log_level="warning", access_log=False, http=_Timed,
                                server_header=False,
                                lifespan="off", timeout_keep_alive=max(1, round(timeout)),
                                timeout_graceful_shutdown=2, backlog=128)
        self._server, self._done = uvicorn.Server(config), threading.Event()

    def serve_forever(self) -> None:
        """Serve until `shutdown()`."""
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._done.set()

    def shutdown(self) -> None:
        """Stop serving; returns once `serve_forever` has."""
        self._server.should_exit = True
        self._done.wait(timeout=10)

    def server_close(self) -> None:
        """Close the listening socket."""
        self.socket.close()


def make_server(app: App, host: str = HOST, port: int = 8000, *,
                allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = (),
                sock: socket.socket | None = None) -> Server:
    """A server for `app` bound to host:port (0: a free port), or on `sock` (a socket
    bound before the model was loaded, `host.web.bound_socket`); not started. It
    answers to `tpkit.host.addresses.allowed_hosts(host, allowed_hosts)` and takes
    browsers' POSTs from its own origin and `allowed_origins` only."""
    guard = Guard(host, allowed_hosts, allowed_origins)
    return Server(build_api(app, guard), sock or bound_socket(host, port), app.timeout)
