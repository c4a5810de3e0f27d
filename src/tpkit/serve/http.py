"""The OpenAI-compatible HTTP front, a thin layer over the `Engine` (rank 0 only).

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p",
                                 "top_k", "seed", "stop", "stream", ...}
    POST /v1/chat/completions   {"model", "messages", ...}: the tokenizer's chat template
    GET  /v1/models   /health   /metrics (Prometheus text)

`stream: true` answers server-sent events, one OpenAI chunk per `data:` line, ending
with `data: [DONE]`. Errors come in OpenAI's JSON shape: 400 a bad request (every field
checked by `tpkit.serve.protocol` before anything is submitted), 403 a foreign Host or
Origin, 404 an unknown model or path, 413 a body over `max_body` bytes or a prompt too
long for the context, 415 a POST that is not JSON, 500 a request the server failed on
(that request alone: the others and the server go on), 503 while shutting down or after
a worker died.

Hardened as the quiz's server is (`tpkit.host.web.Guard`): 127.0.0.1 unless told
otherwise, the Host header must be one of the server's names whatever the address
(DNS rebinding), a browser's cross-origin POST is refused unless its origin is allowed
(then it gets CORS headers), bodies are size-limited before being read, each
connection gives its thread back after `timeout` idle seconds. A client that goes away
(a closed socket, seen while waiting or writing) cancels its request, which frees its
slot at the next step.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from tpkit.host.web import HOST, Guard, Server
from tpkit.serve import openai_api as api
from tpkit.serve import protocol
from tpkit.serve.engine import Engine, TooLong
from tpkit.serve.openai_api import MAX_BODY
from tpkit.serve.request import Done, Failed, Request, RequestFailed, Token
from tpkit.spec.errors import UserError


class App:
    """What the handlers serve: the engine, the model's name, the tokenizer, the limits."""

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
              ) -> tuple[protocol.CompletionRequest | protocol.ChatRequest, list[int]]:
        """(the request, its prompt ids) of a POST body; ApiError for a bad one."""
        body = protocol.parse_json(raw)
        req = protocol.validate(body, chat)
        if req.model not in (None, self.name):
            raise api.ApiError(404, f"model {req.model!r} is not served here "
                                    f"(GET /v1/models: {self.name!r})", "model")
        lock = self.engine.tokenizer_lock
        ids = api.chat_ids(body, self.tokenizer, lock) if chat else \
            api.prompt_ids(req.prompt, self.tokenizer, lock)
        return req, ids

    def submit(self, ids: list[int], params) -> Request:
        """Engine.submit with its errors as ApiErrors (413 too long, 400, 503)."""
        try:
            return self.engine.submit(ids, params)
        except TooLong as e:
            raise api.ApiError(413, str(e), "max_tokens") from None
        except UserError as e:
            raise api.ApiError(400, str(e)) from None
        except RequestFailed as e:
            raise api.ApiError(e.status, str(e)) from None


class Handler(BaseHTTPRequestHandler):
    """One connection; `app` and `guard` are set on a subclass by `make_server`."""

    server_version, sys_version = "tpkit-serve", ""
    app: App
    guard: Guard

    def setup(self) -> None:
        self.timeout = self.app.timeout  # an idle connection gives its thread back
        super().setup()

    def do_OPTIONS(self) -> None:  # noqa: N802 - a browser's preflight
        if self._refused("OPTIONS"):
            return
        if not self._cors():
            return self._error(api.ApiError(403, "cross-origin requests are refused "
                                                 "(--allow-origin ORIGIN allows one)"))
        self.send_response(204)
        for k, v in {**self._cors(), "Access-Control-Allow-Methods": "GET, POST",
                     "Access-Control-Allow-Headers": "Authorization, Content-Type",
                     "Access-Control-Max-Age": "600"}.items():
            self.send_header(k, v)
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self._refused("GET"):
            return
        path, engine = urlsplit(self.path).path, self.app.engine
        if path == "/v1/models":
            return self._json(200, api.models(self.app.name, self.app.created))
        if path == "/health":
            ok = engine.accepting
            return self._json(200 if ok else 503, {"status": "ok" if ok else "unavailable"})
        if path == "/metrics":
            return self._send(200, engine.metrics.render().encode(),
                              "text/plain; version=0.0.4; charset=utf-8")
        self._error(api.ApiError(404, f"no such path: GET {path}"))

    def do_POST(self) -> None:  # noqa: N802
        self._started, self._req = False, None  # response headers sent; the Request
        if self._refused("POST"):
            return
        self.app.enter()
        try:
            self._post()
        except Exception as e:  # noqa: BLE001 - this request fails alone; the server goes on
            self._failed(e)
        finally:
            self.app.leave()

    def _post(self) -> None:
        path = urlsplit(self.path).path
        try:
            if path not in ("/v1/completions", "/v1/chat/completions"):
                raise api.ApiError(404, f"no such path: POST {path}")
            chat = path == "/v1/chat/completions"
            asked, ids = self.app.parse(self._body(), chat)
            req = self._req = self.app.submit(ids, asked.sampling())
        except api.ApiError as e:
            return self._error(e)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.id}"
        if asked.stream:
            return self._stream(req, rid, chat, asked.include_usage)
        for ev in self._events(req):
            if isinstance(ev, Failed):
                return self._error(api.ApiError(ev.status, ev.message))
        text, logprobs = req.text, self._logprobs(req, chat, 0, len(req.tokens))
        if req.params.echo:  # the prompt first (its own log-probabilities, if asked)
            with self.app.engine.tokenizer_lock:
                shown = self.app.tokenizer.decode(req.prompt)
            text = shown + text
            if logprobs is not None:
                before = api.logprobs_block(chat, req.prompt, req.prompt_logprobs,
                                            req.prompt_top, self.app.tokenizer,
                                            self.app.engine.tokenizer_lock)
                after = self._logprobs(req, chat, 0, len(req.tokens),
                                       offset=sum(map(len, before["tokens"])))
                logprobs = {k: before[k] + after[k] for k in before}
        self._json(200, api.completion(rid, self.app.name, text, req.finish_reason,
                                       req.usage, chat, self.app.created, logprobs))

    # -- reading and waiting -----------------------------------------------------------
    def _body(self) -> bytes:
        size = self.headers.get("Content-Length", "")
        if not size.isascii() or not size.isdigit():
            raise api.ApiError(411, "a Content-Length header is needed")
        if int(size) > self.app.max_body:
            self.close_connection = True  # the body is not read
            raise api.ApiError(413, f"body of {size} bytes; at most {self.app.max_body}")
        return self.rfile.read(int(size))

    def _failed(self, e: Exception) -> None:
        """An unexpected error while answering: a 500 (or, mid-stream, an error event)
        to this client, one line on stderr, its generation cancelled."""
        if self._req is not None:
            self._req.cancel()
        why = f"the server failed on this request ({type(e).__name__}: {e})"
        print(f"tpkit serve: error: {why}", file=sys.stderr, flush=True)
        self.close_connection = True
        try:
            if not self._started:
                return self._error(api.ApiError(500, why))
            self._sse(api.ApiError(500, why).body())
            self.wfile.write(b"data: [DONE]\n\n")
        except (OSError, ValueError):
            pass  # the client went away meanwhile

    def _events(self, req: Request):
        """The request's events; cancels it if the client hangs up meanwhile."""
        while True:
            try:
                ev = req.events.get(timeout=0.2)
            except queue.Empty:
                if self._client_gone():
                    req.cancel()
                    return
                continue
            yield ev
            if not isinstance(ev, Token):
                return

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _stream(self, req: Request, rid: str, chat: bool, usage: bool) -> None:
        name, created = self.app.name, self.app.created
        self._started = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-store")
        for k, v in self._cors().items():
            self.send_header(k, v)
        self.end_headers()
        self.close_connection = True  # the body ends when the connection does
        try:
            if chat:  # the assistant's role comes first
                self._sse(api.chunk(rid, name, None, None, chat, created, first=True))
            i, offset = 0, 0  # the token of the next token event; completion characters
            for ev in self._events(req):
                if isinstance(ev, Token):  # one chunk per token (its text may be held back)
                    block = None
                    if ev.token is not None:  # token i (None: text held back until the end)
                        block = self._logprobs(req, chat, i, i + 1, offset)
                        offset += len("".join((block or {}).get("tokens", ())))
                        i += 1
                    self._sse(api.chunk(rid, name, ev.text, None, chat, created,
                                        logprobs=block))
                elif isinstance(ev, Done):
                    self._sse(api.chunk(rid, name, None, ev.reason, chat, created))
                    if usage:
                        self._sse(api.usage_chunk(rid, name, req.usage, chat, created))
                elif isinstance(ev, Failed):
                    self._sse(api.ApiError(ev.status, ev.message).body())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (ConnectionError, TimeoutError, OSError):
            req.cancel()  # the client went away: its slot is freed at the next step

    def _logprobs(self, req: Request, chat: bool, lo: int, hi: int, offset: int = 0
                  ) -> dict | None:
        """Tokens lo..hi-1's log-probabilities in the API's shape (None: not asked for)."""
        if req.params.logprobs is None:
            return None
        return api.logprobs_block(chat, req.tokens[lo:hi], req.logprobs[lo:hi], req.top[lo:hi],
                                  self.app.tokenizer, self.app.engine.tokenizer_lock, offset)

    def _sse(self, payload: dict) -> None:
        self.wfile.write(b"data: " + _encode(payload) + b"\n\n")
        self.wfile.flush()

    # -- writing -----------------------------------------------------------------------
    def _refused(self, method: str) -> bool:
        refusal = self.guard.refusal(method, self.headers)
        if refusal is None:
            return False
        self.close_connection = True  # a refused body is not read
        self._error(api.ApiError(*refusal))
        return True

    def _cors(self) -> dict[str, str]:
        """The CORS headers of an allowed --allow-origin (none for any other origin)."""
        origin = self.headers.get("Origin") or ""
        if not origin or not self.guard.origin_allowed(origin):
            return {}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def _error(self, e: api.ApiError) -> None:
        self._json(e.status, e.body())

    def _json(self, status: int, body: dict) -> None:
        self._send(status, _encode(body), "application/json")

    def _send(self, status: int, data: bytes, ctype: str) -> None:
        self._started = True
        try:
            self.send_response(HTTPStatus(status))
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in self._cors().items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except (ConnectionError, TimeoutError):
            pass  # the client went away

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet server
        pass


def _encode(body: dict) -> bytes:
    """JSON bytes; a lone surrogate (an unknown field's name) as its JSON escape."""
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")


def make_server(app: App, host: str = HOST, port: int = 8000, *,
                allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = (),
                sock: socket.socket | None = None) -> Server:
    """A server for `app` bound to host:port (0: a free port), or on `sock` (a socket
    bound before the model was loaded, `host.web.bound_socket`); not started. It
    answers to `tpkit.host.addresses.allowed_hosts(host, allowed_hosts)` and takes
    browsers' POSTs from its own origin and `allowed_origins` only."""
    guard = Guard(host, allowed_hosts, allowed_origins)
    handler = type("BoundHandler", (Handler,), {"app": app, "guard": guard})
    if sock is None:
        return Server.on(host)((host, port), handler)
    server = Server.on(host)((host, port), handler, bind_and_activate=False)
    server.socket.close()
    server.socket, server.server_address = sock, sock.getsockname()
    return server
