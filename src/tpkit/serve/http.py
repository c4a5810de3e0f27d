"""The OpenAI-compatible HTTP front on FastAPI + uvicorn, a thin layer over the `Engine`
(rank 0 only).

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p",
                                 "top_k", "seed", "stop", "stream", ...}
    POST /v1/chat/completions   {"model", "messages", ...}: the tokenizer's chat template
    POST /v1/responses          {"model", "input", ...}: OpenAI's Responses API
                                (`tpkit.serve.responses`)
    POST /v1/embeddings         {"model", "input", "encoding_format"}: an encoder's
                                (`tpkit.serve.embeddings`; the others answer 400 there)

Every POST is answered by one skeleton (`tpkit.serve.post.answer`: body, parse and
submit in one call, `App.post`, then streamed or awaited); the routes differ only in
the body's shape.
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

import socket
import threading
from collections.abc import Iterable

import h11
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from tpkit.host.web import HOST, Guard, bound_socket
from tpkit.serve import openai_api as api
from tpkit.serve import protocol
from tpkit.serve.app import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, App
from tpkit.serve.post import Answers, answer


def _schema(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


def build_api(app: App, guard: Guard) -> FastAPI:
    """The FastAPI application of `app`, behind `guard`."""
    fa = FastAPI(title="tpkit serve", summary="OpenAI-compatible completions",
                 redoc_url=None)
    out = Answers(guard)
    cors, error, ok = out.cors, out.error, out.ok

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
        return await answer(app, out, request, COMPLETIONS)

    @fa.post("/v1/chat/completions", summary="a chat completion (OpenAI's API)",
             openapi_extra=_schema(protocol.ChatRequest))
    async def chat_completions(request: HttpRequest):
        return await answer(app, out, request, CHAT)

    @fa.post("/v1/responses", summary="a response (OpenAI's Responses API)")
    async def responses(request: HttpRequest):
        return await answer(app, out, request, RESPONSES)

    @fa.post("/v1/embeddings", summary="embeddings of an encoder model (OpenAI's API)",
             openapi_extra=_schema(protocol.EmbeddingRequest))
    async def embeddings(request: HttpRequest):
        return await answer(app, out, request, EMBEDDINGS)

    return fa


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
