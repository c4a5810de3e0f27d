"""The web tutor: `tpkit quiz --web` serves the quiz page on 127.0.0.1 only.

    GET /  /index.html  /app.js  /style.css   the page (these files and nothing else)
    GET /api/quiz                             questions, options, answers, explanations (fr, en)
    GET /api/live/<n>?tp=2&lang=fr            live demonstration n, told in lang (with --live)

Requests are answered from a fixed table of files, so no path from the URL ever reaches
the file system (no traversal). A Host header other than 127.0.0.1/localhost is
refused (DNS rebinding). Live demonstrations run one at a time, tp in {2, 4}, in the
language asked (the server's by default), and are cached; without `--live` their
endpoint answers 404. Pure Python unless `--live`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from tpkit.quiz.content import Quiz

HOST = "127.0.0.1"
STATIC = {  # URL path -> (file in tpkit/quiz/web, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
LIVE_TP = (2, 4)
LiveRunner = Callable[[int, int, str], dict]  # (question number, tp, lang) -> figures + "text"


def quiz_payload(quiz: Quiz, lang: str, live: bool) -> dict:
    """What `/api/quiz` returns: the whole content plus the page's settings."""
    return dict(quiz.data, default_lang=lang, live=live, live_tp=list(LIVE_TP))


class _Live:
    """Runs live demonstrations one at a time and caches their results."""

    def __init__(self, runner: LiveRunner) -> None:
        self.runner, self.lock, self.cache = runner, threading.Lock(), {}

    def get(self, number: int, tp: int, lang: str) -> tuple[HTTPStatus, dict]:
        key = (number, tp, lang)
        if key in self.cache:
            return HTTPStatus.OK, self.cache[key]
        if not self.lock.acquire(blocking=False):
            return HTTPStatus.TOO_MANY_REQUESTS, {"error": "a demonstration is already running"}
        try:
            result = self.runner(number, tp, lang)
        except Exception as e:  # noqa: BLE001 - reported to the page, the server lives on
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"}
        finally:
            self.lock.release()
        self.cache[key] = result
        return HTTPStatus.OK, result


def make_handler(quiz: Quiz, lang: str, live: LiveRunner | None) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to one quiz (and optionally a live runner)."""
    payload = json.dumps(quiz_payload(quiz, lang, live is not None), ensure_ascii=False).encode()
    files = {name: resources.files("tpkit.quiz").joinpath("web", name).read_bytes()
             for name, _ in STATIC.values()}
    runner = _Live(live) if live is not None else None

    class Handler(BaseHTTPRequestHandler):
        server_version = "tpkit-quiz"
        sys_version = ""

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._answer(send_body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(send_body=False)

        def _answer(self, send_body: bool) -> None:
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
            if host not in (HOST, "localhost"):
                return self._send(HTTPStatus.FORBIDDEN, b"forbidden host\n", "text/plain",
                                  send_body)
            url = urlsplit(self.path)
            if url.path in STATIC:
                name, ctype = STATIC[url.path]
                return self._send(HTTPStatus.OK, files[name], ctype, send_body)
            if url.path == "/api/quiz":
                return self._send(HTTPStatus.OK, payload, "application/json", send_body)
            if url.path.startswith("/api/live/") and runner is not None:
                status, body = _live_request(runner, url.path, parse_qs(url.query),
                                             lang, quiz.languages)
                data = json.dumps(body, ensure_ascii=False).encode()
                return self._send(status, data, "application/json", send_body)
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain", send_body)

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


def _live_request(runner: _Live, path: str, query: dict, default_lang: str,
                  languages: list[str]) -> tuple[HTTPStatus, dict]:
    number, tp = path.removeprefix("/api/live/"), (query.get("tp") or ["2"])[0]
    lang = (query.get("lang") or [default_lang])[0]
    if not number.isdigit() or not 1 <= int(number) <= 8:
        return HTTPStatus.NOT_FOUND, {"error": "demonstrations are numbered 1 to 8"}
    if not tp.isdigit() or int(tp) not in LIVE_TP:
        return HTTPStatus.BAD_REQUEST, {"error": f"tp must be one of {list(LIVE_TP)}"}
    if lang not in languages:
        return HTTPStatus.BAD_REQUEST, {"error": f"lang must be one of {languages}"}
    return runner.get(int(number), int(tp), lang)


def make_server(quiz: Quiz, port: int = 0, lang: str = "en",
                live: LiveRunner | None = None) -> ThreadingHTTPServer:
    """A server bound to 127.0.0.1:`port` (0: any free port); not started."""
    server = ThreadingHTTPServer((HOST, port), make_handler(quiz, lang, live))
    server.daemon_threads = True
    return server


def serve(quiz: Quiz, port: int = 8765, lang: str = "en", live: bool = False) -> int:
    """Serve until interrupted; prints the URL. Returns the exit code."""
    session = None
    runner: LiveRunner | None = None
    if live:
        from tpkit.quiz.live import LiveSession

        session = LiveSession()
        runner = session.run
    server = make_server(quiz, port, lang, runner)
    print(f"tpkit quiz: http://{HOST}:{server.server_address[1]}/?lang={lang} "
          f"(Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if session is not None:
            session.close()
    return 0
