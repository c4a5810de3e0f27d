"""The OpenAI-compatible HTTP front, a thin layer over the `Engine` (rank 0 only).

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p",
                                 "top_k", "seed", "stop", "stream", ...}
    POST /v1/chat/completions   {"model", "messages", ...}: the tokenizer's chat template
    GET  /v1/models   /health   /metrics (Prometheus text)

`stream: true` answers server-sent events, one OpenAI chunk per `data:` line, ending
with `data: [DONE]`. Errors come in OpenAI's JSON shape: 400 a bad request, 404 an
unknown model or path, 413 a body over `max_body` bytes or a prompt too long for the
context, 503 while shutting down or after a worker died.

Hardened as the quiz's server is: 127.0.0.1 unless told otherwise, the Host header must
name the address served (DNS rebinding), bodies are size-limited before being read,
each connection gives its thread back after `timeout` idle seconds. A client that goes
away (a closed socket, seen while waiting or writing) cancels its request, which frees
its slot at the next step.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tpkit.host.addresses import allowed_hosts, host_of
from tpkit.serve import openai_api as api
from tpkit.serve.engine import Engine, TooLong
from tpkit.serve.request import Request, RequestFailed
from tpkit.spec.errors import UserError

HOST = "127.0.0.1"
MAX_BODY = 1 << 20  # bytes of a request body


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

    def parse(self, path: str, body: dict) -> tuple[list[int], api.SamplingParams, bool]:
        """(prompt ids, params, chat?) of a POST body; ApiError for a bad one."""
        if body.get("model") not in (None, self.name):
            raise api.ApiError(404, f"model {body.get('model')!r} is not served here "
                                    f"(GET /v1/models: {self.name!r})", "model")
        chat = path == "/v1/chat/completions"
        params = api.sampling(body, chat)
        lock = self.engine.tokenizer_lock
        ids = api.chat_ids(body, self.tokenizer, lock) if chat else \
            api.prompt_ids(body, self.tokenizer, lock)
        return ids, params, chat

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
    """One connection; `app` and `hosts` are set on a subclass by `make_server`."""

    server_version, sys_version = "tpkit-serve", ""
    app: App
    hosts: set[str] | None

    def setup(self) -> None:
        self.timeout = self.app.timeout  # an idle connection gives its thread back
        super().setup()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self._host_refused():
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
        if self._host_refused():
            return
        self.app.enter()
        try:
            self._post()
        finally:
            self.app.leave()

    def _post(self) -> None:
        path = urlsplit(self.path).path
        try:
            if path not in ("/v1/completions", "/v1/chat/completions"):
                raise api.ApiError(404, f"no such path: POST {path}")
            body = self._body()
            ids, params, chat = self.app.parse(path, body)
            req = self.app.submit(ids, params)
        except api.ApiError as e:
            return self._error(e)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.id}"
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return self._stream(req, rid, chat, usage)
        for ev in self._events(req):
            if ev[0] == "error":
                return self._error(api.ApiError(ev[1], ev[2]))
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
    def _body(self) -> dict:
        size = self.headers.get("Content-Length", "")
        if not size.isascii() or not size.isdigit():
            raise api.ApiError(411, "a Content-Length header is needed")
        if int(size) > self.app.max_body:
            self.close_connection = True  # the body is not read
            raise api.ApiError(413, f"body of {size} bytes; at most {self.app.max_body}")
        try:
            body = json.loads(self.rfile.read(int(size)))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise api.ApiError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise api.ApiError(400, "the body must be a JSON object")
        return body

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
            if ev[0] != "token":
                return

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _stream(self, req: Request, rid: str, chat: bool, usage: bool) -> None:
        name, created = self.app.name, self.app.created
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.close_connection = True  # the body ends when the connection does
        try:
            if chat:  # the assistant's role comes first
                self._sse(api.chunk(rid, name, None, None, chat, created, first=True))
            i, offset = 0, 0  # the token of the next token event; completion characters
            for ev in self._events(req):
                if ev[0] == "token":  # one chunk per token (its text may be held back: "")
                    block = None
                    if ev[1] is not None:  # token i (a None: text held back until the end)
                        block = self._logprobs(req, chat, i, i + 1, offset)
                        offset += len("".join((block or {}).get("tokens", ())))
                        i += 1
                    self._sse(api.chunk(rid, name, ev[2], None, chat, created,
                                        logprobs=block))
                elif ev[0] == "done":
                    self._sse(api.chunk(rid, name, None, ev[1], chat, created))
                    if usage:
                        self._sse(api.usage_chunk(rid, name, req.usage, chat, created))
                elif ev[0] == "error":
                    self._sse(api.ApiError(ev[1], ev[2]).body())
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
        self.wfile.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")
        self.wfile.flush()

    # -- writing -----------------------------------------------------------------------
    def _host_refused(self) -> bool:
        if self.hosts is None or host_of(self.headers.get("Host") or "") in self.hosts:
            return False
        self._error(api.ApiError(403, "forbidden host"))
        return True

    def _error(self, e: api.ApiError) -> None:
        self._json(e.status, e.body())

    def _json(self, status: int, body: dict) -> None:
        self._send(status, json.dumps(body, ensure_ascii=False).encode(), "application/json")

    def _send(self, status: int, data: bytes, ctype: str) -> None:
        try:
            self.send_response(HTTPStatus(status))
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (ConnectionError, TimeoutError):
            pass  # the client went away

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet server
        pass


class Server(ThreadingHTTPServer):
    """A threading server whose clients may vanish: no traceback for a broken pipe."""

    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return
        super().handle_error(request, client_address)


def make_server(app: App, host: str = HOST, port: int = 8000) -> Server:
    """A server for `app` bound to host:port (0: a free port); not started."""
    handler = type("BoundHandler", (Handler,), {"app": app, "hosts": allowed_hosts(host)})
    cls = Server
    if ":" in host:
        cls = type("Server6", (Server,), {"address_family": socket.AF_INET6})
    return cls((host, port), handler)
