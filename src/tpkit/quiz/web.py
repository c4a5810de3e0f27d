"""The web tutor: `tpkit quiz --web` serves the quiz page (on 127.0.0.1 unless `--host`).

    GET  /  /index.html  /app.js  /charts.js  /style.css  /favicon.ico   the page
    GET  /api/quiz                          questions and options (fr, en; both levels)
    POST /api/answer  {"level", "number", "choice"}   the verdict and the explanations
    GET  /api/live/<n>?tp=2&lang=fr&level=1 live demonstration n (with --live)

Requests are answered from a fixed table of files, so no path from the URL ever reaches
the file system (no traversal). The Host header must name this server (DNS
rebinding), a POST must be JSON from the page's own origin (`tpkit.host.web.Guard`);
a POST body over `MAX_BODY` bytes gets 413, one that is not JSON 400.
Each connection is dropped after `timeout` idle seconds, so half-open connections do
not hold threads; a client that goes away mid-answer is not an error. Live
demonstrations run one at a time, tp in {2, 4}, in the language asked, and are cached;
without `--live` their endpoint answers 404. SIGTERM, SIGHUP and SIGINT stop the server
and the worker processes of the demonstrations. Pure Python unless `--live`.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from tpkit.host.exit import Stopped
from tpkit.host.web import HOST, Guard, Server, listen, warn_if_exposed
from tpkit.quiz import web_api
from tpkit.quiz.content import Quiz
from tpkit.quiz.live import LiveSession

HTML, JS = "text/html; charset=utf-8", "text/javascript; charset=utf-8"
STATIC = {  # URL path -> (file in tpkit/quiz/page, content type)
    "/": ("index.html", HTML), "/index.html": ("index.html", HTML),
    "/app.js": ("app.js", JS), "/charts.js": ("charts.js", JS),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
    "/favicon.ico": ("favicon.svg", "image/svg+xml"), "/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
LiveRunner = Callable[[int, int, int, str], dict]  # (level, number, tp, lang) -> figures


class _Live:
    """Runs live demonstrations one at a time and caches their results."""

    def __init__(self, runner: LiveRunner) -> None:
        self.runner, self.lock, self.cache = runner, threading.Lock(), {}

    def get(self, key: tuple[int, int, int, str]) -> web_api.Reply:
        if key in self.cache:
            return HTTPStatus.OK, self.cache[key]
        if not self.lock.acquire(blocking=False):
            return HTTPStatus.TOO_MANY_REQUESTS, {"error": "a demonstration is already running"}
        try:
            result = self.runner(*key)
        except Exception as e:  # noqa: BLE001 - reported to the page, the server lives on
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"}
        finally:
            self.lock.release()
        self.cache[key] = result
        return HTTPStatus.OK, result


def make_handler(quiz: Quiz, lang: str, live: LiveRunner | None, guard: Guard,
                 timeout: float) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to one quiz (and optionally a live runner)."""
    payload = json.dumps(web_api.quiz_payload(quiz, lang, live is not None),
                         ensure_ascii=False).encode()
    files = {name: resources.files("tpkit.quiz").joinpath("page", name).read_bytes()
             for name, _ in STATIC.values()}
    runner = _Live(live) if live is not None else None

    class Handler(BaseHTTPRequestHandler):
        server_version, sys_version = "tpkit-quiz", ""

        def setup(self) -> None:
            self.timeout = timeout  # socket timeout: an idle connection gives its thread back
            super().setup()

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._get(send_body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._get(send_body=False)

        def do_POST(self) -> None:  # noqa: N802
            if self._refused("POST"):
                return
            if urlsplit(self.path).path != "/api/answer":
                return self._json(HTTPStatus.NOT_FOUND, {"error": "POST only to /api/answer"})
            size = self.headers.get("Content-Length", "")
            if not size.isascii() or not size.isdigit():
                return self._json(HTTPStatus.LENGTH_REQUIRED, {"error": "Content-Length needed"})
            if int(size) > web_api.MAX_BODY:
                self.close_connection = True  # the body is not read
                return self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                  {"error": f"body of {size} bytes; at most {web_api.MAX_BODY}"})
            body = web_api.parse_body(self.rfile.read(int(size)))
            self._json(*(body if isinstance(body, tuple) else web_api.check_answer(quiz, body)))

        def _get(self, send_body: bool) -> None:
            if self._refused("GET", send_body):
                return
            url = urlsplit(self.path)
            if url.path in STATIC:
                name, ctype = STATIC[url.path]
                return self._send(HTTPStatus.OK, files[name], ctype, send_body)
            if url.path == "/api/quiz":
                return self._send(HTTPStatus.OK, payload, "application/json", send_body)
            if url.path.startswith("/api/live/") and runner is not None:
                key = web_api.live_request(url.path, parse_qs(url.query), lang, quiz.languages)
                reply = key if len(key) == 2 else runner.get(key)
                return self._json(*reply, send_body=send_body)
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain", send_body)

        def _refused(self, method: str, send_body: bool = True) -> bool:
            refusal = guard.refusal(method, self.headers)
            if refusal is None:
                return False
            self.close_connection = True  # a refused body is not read
            self._json(HTTPStatus(refusal[0]), {"error": refusal[1]}, send_body)
            return True

        def _json(self, status: HTTPStatus, body: dict, send_body: bool = True) -> None:
            data = json.dumps(body, ensure_ascii=False).encode()
            self._send(status, data, "application/json", send_body)

        def _send(self, status: HTTPStatus, body: bytes, ctype: str, send_body: bool) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in HEADERS.items():
                self.send_header(k, v)
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet server
            pass

    return Handler


def make_server(quiz: Quiz, port: int = 0, lang: str = "en", live: LiveRunner | None = None,
                host: str = HOST, timeout: float = 15.0, allowed_hosts: Iterable[str] = ()
                ) -> Server:
    """A server bound to `host`:`port` (0: any free port); not started. It answers to
    the Host names of `tpkit.host.addresses.allowed_hosts(host, allowed_hosts)`."""
    handler = make_handler(quiz, lang, live, Guard(host, allowed_hosts), timeout)
    return Server.on(host)((host, port), handler)


def serve(quiz: Quiz, port: int = 8765, lang: str = "en", live: bool = False,
          host: str = HOST, comm: str | None = None, allowed_hosts: Iterable[str] = (),
          hosts: bool | None = None) -> int:
    """Serve until SIGINT, SIGTERM or SIGHUP; prints the URL. Returns the exit code:
    128 + the signal's number, as every command stopped by a signal. `hosts`: as
    `LiveSession`'s (None: answers 3 and 8 also across simulated hosts when possible)."""
    server = listen(lambda: make_server(quiz, port, lang, None, host,
                                        allowed_hosts=allowed_hosts), host, port)
    warn_if_exposed("tpkit quiz", host, "the quiz")
    session = None
    if live:
        session = LiveSession(comm=comm, hosts=hosts)
        def runner(level: int, number: int, tp: int, lang_: str) -> dict:
            return session.run(number, tp, lang_, level)

        server.RequestHandlerClass = make_handler(quiz, lang, runner,
                                                  Guard(host, allowed_hosts), 15.0)
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, _interrupt) for s in stops}  # before the URL is shown
    status = 0
    try:
        print(f"tpkit quiz: http://{shown}:{server.server_address[1]}/?lang={lang} "
              f"(Ctrl-C to stop)", flush=True)
        server.serve_forever()
    except KeyboardInterrupt as e:
        status = 128 + getattr(e, "signum", signal.SIGINT)
    finally:
        for s in stops:  # a second signal must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        server.server_close()
        if session is not None:
            session.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status


def _interrupt(signum: int, frame) -> None:
    raise Stopped(signum)
