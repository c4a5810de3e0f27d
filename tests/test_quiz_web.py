"""The web tutor: the page's files only, hardened endpoints, clean shutdown, a real browser.

Server: only the page's files are served (traversal refused, encoded too), the Host
header must name the address served, POST bodies are bounded (413) and must be JSON
(400), unknown questions/levels/languages get 404/400 with a message, 200 concurrent
requests are all answered, idle connections time out, a vanished client is not a
traceback, and `tpkit quiz --web --live` leaves no process behind on SIGTERM or SIGINT
(exiting 128 + the signal, as every command).
Browser: Debian's chromium via Playwright, at 1280 px and 390x844, in both languages
and both levels: answers hidden before choosing, a chart for every demonstration,
nothing wider than the page, no console error. It fails (never skips) when chromium
or playwright is missing: `make browser` installs them.
"""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from proc_tree import descendants, wait_gone
from tpkit.quiz.content import load_quiz
from tpkit.quiz.web import make_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
CLI = "import sys; from tpkit.cli import main; sys.exit(main(sys.argv[1:]))"


def _serve(live=None, timeout: float = 15.0, host: str = "127.0.0.1"):
    server = make_server(load_quiz(), port=0, lang="fr", live=live, timeout=timeout, host=host)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _stop(server) -> None:
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def server():
    calls = []

    def fake_live(level: int, number: int, tp: int, lang: str) -> dict:  # the web layer only
        calls.append((level, number, tp, lang))
        return {"text": f"demo {level}.{number} at tp={tp} ({lang})", "tp": tp, "charts": []}

    srv = _serve(fake_live)
    srv.calls = calls
    yield srv
    _stop(srv)


def get(server, path: str, host: str | None = None, method: str = "GET", body: bytes | None = None,
        headers: dict | None = None):
    port = server.server_address[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, body=body,
                 headers={"Host": host or f"127.0.0.1:{port}", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, resp.getheader("Content-Type"), data


def post(server, body: bytes, path: str = "/api/answer"):
    return get(server, path, method="POST", body=body,
               headers={"Content-Type": "application/json"})


def test_binds_to_loopback_by_default(server):
    assert server.server_address[0] == "127.0.0.1"


@pytest.mark.parametrize("path", ["/", "/index.html", "/app.js", "/charts.js", "/style.css",
                                  "/favicon.ico"])
def test_page_files_are_served(server, path):
    status, ctype, body = get(server, path)
    assert status == 200 and body
    assert ctype.split(";")[0] in ("text/html", "text/javascript", "text/css", "image/svg+xml")


@pytest.mark.parametrize("path", ["/../questions.json", "/questions.json", "/page/app.js",
                                  "/%2e%2e/content.py", "/..%2f..%2fpyproject.toml",
                                  "/%2e%2e%2f%2e%2e%2fpyproject.toml", "/%252e%252e/web.py",
                                  "/..%5c..%5cweb.py", "/app.js/../../cli.py", "//etc/passwd",
                                  "/content.py", "/%c0%ae%c0%ae/web.py"])
def test_nothing_else_is_served(server, path):
    status, _, body = get(server, path)
    assert status == 404, (path, body[:80])


def test_foreign_host_header_is_refused(server):
    assert get(server, "/", host="evil.example:80")[0] == 403
    assert get(server, "/api/quiz", host="localhost:1")[0] == 200
    assert post(server, b"{}")[0] != 403
    port = server.server_address[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/api/answer", body=b"{}", headers={"Host": "evil.example"})
    assert conn.getresponse().status == 403


def test_host_check_follows_the_chosen_host():
    from tpkit.host.addresses import allowed_hosts, host_of

    assert allowed_hosts("127.0.0.1") >= {"127.0.0.1", "localhost"}
    assert allowed_hosts("192.168.1.5") == {"192.168.1.5"}  # no loopback names then
    assert allowed_hosts("192.168.1.5", ["Quiz.LAN"]) == {"192.168.1.5", "quiz.lan"}
    everywhere = allowed_hosts("0.0.0.0")  # still a list: this machine's names
    assert {"localhost", "127.0.0.1", "::1", socket.gethostname().lower()} <= everywhere
    assert "evil.example" not in everywhere
    assert host_of("[::1]:8765") == "::1" and host_of("localhost:80") == "localhost"
    srv = _serve(host="127.0.0.2")
    try:
        port = srv.server_address[1]
        conn = http.client.HTTPConnection("127.0.0.2", port, timeout=10)
        for host, status in (("127.0.0.2", 200), (f"127.0.0.2:{port}", 200), ("evil", 403)):
            conn.request("GET", "/api/quiz", headers={"Host": host})
            resp = conn.getresponse()
            resp.read()
            assert resp.status == status, host
    finally:
        _stop(srv)


def test_wildcard_host_keeps_an_allowlist_and_posts_come_from_the_page():
    """--host 0.0.0.0: the machine's own names pass, another (DNS rebinding) gets 403;
    a POST from another origin, or not JSON (a browser's "simple" request), is refused."""
    srv = _serve(host="0.0.0.0")
    try:
        port, answer = srv.server_address[1], json.dumps({"level": 1, "number": 1,
                                                          "choice": 1}).encode()
        for host, status in (("evil.example", 403), (socket.gethostname(), 200),
                             (f"localhost:{port}", 200)):
            assert get(srv, "/api/quiz", host=host)[0] == status, host
        own = {"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}"}
        for headers, status in ((own, 200), ({**own, "Origin": "http://evil.example"}, 403),
                                ({"Content-Type": "text/plain"}, 415), ({}, 415)):
            got = get(srv, "/api/answer", method="POST", body=answer, headers=headers)
            assert got[0] == status, (headers, got)
    finally:
        _stop(srv)


def test_quiz_endpoint_has_both_languages_and_levels_but_no_answers(server):
    status, ctype, body = get(server, "/api/quiz")
    data = json.loads(body)
    assert status == 200 and ctype == "application/json"
    assert data["languages"] == ["fr", "en"] and data["default_lang"] == "fr"
    assert [len(data["levels"][k]) for k in ("1", "2")] == [8, 8] and data["live"] is True
    for q in data["levels"]["1"] + data["levels"]["2"]:
        assert set(q) == {"number", "id", "diagram", "fr", "en"}
        assert set(q["fr"]) == set(q["en"]) == {"question", "options"}
    assert load_quiz().items("en")[1].explanation[:40] not in body.decode()


def test_answer_endpoint_gives_verdict_and_explanations(server):
    quiz = load_quiz()
    status, _, body = post(server, json.dumps({"level": 1, "number": 2, "choice": 1}).encode())
    reply = json.loads(body)
    assert status == 200 and reply["right"] is True and reply["answer"] == 1
    assert reply["explanation"]["en"] == quiz.items("en")[1].explanation
    reply = json.loads(post(server, b'{"level": 2, "number": 8, "choice": 0}')[2])
    assert reply["right"] is False and reply["answer"] == quiz.questions(2)[7]["answer"]


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not JSON"), (b"\xff\xfe", 400, "not JSON"), (b"[1, 2]", 400, "object"),
    (b'{"level": 1, "number": "2", "choice": 1}', 400, "integers"),
    (b'{"level": 1, "number": 9, "choice": 1}', 404, "no question 9"),
    (b'{"level": 3, "number": 1, "choice": 1}', 404, "no level 3"),
    (b'{"level": 1, "number": 1, "choice": 4}', 400, "choice=4"),
    (b'{"level": true, "number": 1, "choice": 1}', 400, "integers"),
    (b"[" * 2000 + b"]" * 2000, 400, "nested too deeply")])  # was: RecursionError, dropped
def test_bad_answers_are_refused_with_a_message(server, body, status, message):
    got, _, data = post(server, body)
    assert got == status and message in json.loads(data)["error"]


def test_body_over_the_limit_gets_413(server):
    from tpkit.quiz.web_api import MAX_BODY

    status, _, data = post(server, b"x" * (MAX_BODY + 1))
    assert status == 413 and str(MAX_BODY) in json.loads(data)["error"]
    assert post(server, b"{}", path="/api/quiz")[0] == 404


def test_live_endpoint_is_bounded(server):
    status, _, body = get(server, "/api/live/3?tp=4")
    assert status == 200 and json.loads(body)["text"] == "demo 1.3 at tp=4 (fr)"  # server's lang
    assert get(server, "/api/live/3?tp=4&lang=fr")[0] == 200
    assert server.calls == [(1, 3, 4, "fr")]  # cached
    assert json.loads(get(server, "/api/live/3?tp=4&lang=en&level=2")[2])["text"] == \
        "demo 2.3 at tp=4 (en)"
    for path, status, message in (("/api/live/9", 404, "numbered 1 to 8"),
                                  ("/api/live/%C2%B2", 404, "numbered"),  # '²'.isdigit()
                                  ("/api/live/1?tp=3", 400, "tp must"),
                                  ("/api/live/1?tp=%C2%B2", 400, "tp must"),
                                  ("/api/live/1?tp=2x", 400, "tp must"),
                                  ("/api/live/1?lang=de", 400, "lang must"),
                                  ("/api/live/1?level=3", 404, "level must")):
        got, _, data = get(server, path)
        assert got == status and message in json.loads(data)["error"], path


def test_200_concurrent_requests_are_answered(server):
    paths = ["/", "/api/quiz", "/app.js", "/api/live/2?tp=2"] * 50
    with ThreadPoolExecutor(max_workers=50) as pool:
        statuses = list(pool.map(lambda p: get(server, p)[0], paths))
    assert statuses == [200] * 200


def _request_threads(than: set) -> list[threading.Thread]:
    """The live threads serving one connection each (socketserver names them after
    `process_request_thread`), other than those in `than`."""
    return [t for t in threading.enumerate()
            if t not in than and "process_request_thread" in t.name]


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.mark.timeout(180)
def test_idle_connections_time_out_and_give_their_threads_back():
    srv = _serve(timeout=4.0)  # long enough for all 40 threads to be seen at once
    try:
        before = set(threading.enumerate())
        socks = [socket.create_connection(srv.server_address, timeout=5) for _ in range(40)]
        for s in socks[:20]:
            s.sendall(b"GET / HTTP/1.1\r\n")  # half a request, then silence
        # each connection holds a thread (counted here, not the process's: another
        # server's threads may end meanwhile) ...
        assert _wait(lambda: len(_request_threads(before)) == 40, 60), \
            len(_request_threads(before))
        # ... until its timeout, not forever (the sockets are still open)
        assert _wait(lambda: not _request_threads(before), 120), _request_threads(before)
        for s in socks:
            s.close()
        assert get(srv, "/api/quiz")[0] == 200
    finally:
        _stop(srv)


def test_a_client_that_goes_away_is_not_a_traceback(server, capfd):
    before = set(threading.enumerate())
    for _ in range(20):  # ask for the big payload, then reset the connection at once
        s = socket.create_connection(server.server_address, timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.sendall(f"GET /api/quiz HTTP/1.1\r\nHost: 127.0.0.1:{server.server_address[1]}\r\n\r\n"
                  .encode())
        s.close()
    try:
        raise BrokenPipeError(32, "Broken pipe")
    except BrokenPipeError:
        server.handle_error(None, ("127.0.0.1", 1))  # what socketserver calls on it
    assert get(server, "/api/quiz")[0] == 200
    assert _wait(lambda: not _request_threads(before), 60)  # every reset one was handled
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_live_endpoint_absent_without_live():
    srv = _serve(None)
    try:
        assert get(srv, "/api/live/1")[0] == 404
        assert json.loads(get(srv, "/api/quiz")[2])["live"] is False
    finally:
        _stop(srv)


def _start_cli(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", CLI, "quiz", "--web", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "http://" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.split()[2]


def test_port_in_use_is_one_clear_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-c", CLI, "quiz", "--web", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"tpkit quiz: error: port {port} is already in use on "
                                f"127.0.0.1; choose another with --port (--port 0 picks a "
                                f"free one)")


def test_non_loopback_host_warns():
    proc, url = _start_cli("--host", "0.0.0.0", "--port", "0")
    try:
        assert url.startswith("http://127.0.0.1:")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 128 + signal.SIGINT
    assert "warning: --host 0.0.0.0" in proc.stderr.read()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_server_and_every_child(sig):
    proc, url = _start_cli("--live", "--port", "0", "--lang", "en")
    try:
        port = int(url.split(":")[2].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("GET", "/api/live/1?tp=2")  # starts the worker pool
        assert conn.getresponse().status == 200
        family = descendants(proc.pid)
        assert len(family) >= 2  # forkserver, workers, resource tracker
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 128 + sig
        assert wait_gone(family, 10)[1] == []  # every child stopped within 10 s
    finally:
        if proc.poll() is None:
            proc.kill()


# -- the browser ------------------------------------------------------------------------------
def _sync_api():
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: `pip install -e '.[web]'` (see `make test`)")
    expect.set_options(timeout=30_000)  # not 5 s: a loaded 2-core machine renders slowly
    return expect, sync_playwright


def _browser(playwright):
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} not found: the browser test needs Debian's chromium "
                    f"(run `make browser`, or `apt-get install chromium`)")
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


@pytest.fixture(scope="module")
def live_server(pools):
    from tpkit.quiz.live import LiveSession

    session = LiveSession(runner=pools.run)
    srv = _serve(lambda level, n, tp, lang: session.run(n, tp, lang, level))
    yield srv
    _stop(srv)


OVERFLOW_JS = """() => [...document.querySelectorAll('.question, .live, figure, svg, pre, #review')]
  .filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 1
               || e.scrollWidth > e.clientWidth + 1)
  .map(e => e.className.baseVal ?? e.className ?? e.tagName)
  .concat(document.documentElement.scrollWidth > document.documentElement.clientWidth
          ? ['page'] : [])"""


def _answer_all(page, expect, level: str, lang: str, live: bool) -> int:
    quiz = load_quiz()
    wrong = 0
    for n in range(1, 9):
        section = page.locator(f"#q{n}")
        expect(section.locator(".explanation")).to_have_count(0)  # hidden before choosing
        expect(section.locator("svg")).to_have_count(0)
        expect(section.locator(".option.right")).to_have_count(0)
        option = section.locator(".option").nth(n % 4)
        seed_index = int(option.get_attribute("data-index"))
        option.click()
        q = quiz.questions(int(level))[n - 1]
        expect(section.locator(".explanation")).to_contain_text(
            quiz.items(lang, int(level))[n - 1].explanation[:60])
        verdict = "right" if seed_index == q["answer"] else "wrong"
        wrong += verdict == "wrong"
        expect(section.locator(f".verdict.{verdict}")).to_have_count(1)
        if level == "1":
            expect(section.locator("svg.diagram")).to_have_count(1)
        if live:
            section.locator(".live button").click()
            expect(section.locator(".live svg.chart").first).to_be_visible(timeout=60_000)
            expect(section.locator(".live details pre")).to_have_count(1)
            expect(section.locator(".live details")).not_to_have_attribute("open", "")
    return wrong


@pytest.mark.timeout(300)
@pytest.mark.parametrize("viewport", [dict(width=1280, height=900), dict(width=390, height=844)],
                         ids=["desktop", "phone"])
def test_browser_both_levels_both_languages_charts_fit(live_server, viewport):
    expect, sync_playwright = _sync_api()
    quiz = load_quiz()
    base = f"http://127.0.0.1:{live_server.server_address[1]}/?seed=5"
    errors: list[str] = []
    with sync_playwright() as p:
        browser = _browser(p)
        page = browser.new_page(viewport=viewport)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(f"{base}&lang=fr&level=1")
        for level, lang in (("1", "fr"), ("2", "en")):
            page.click(f"#lang-{lang}")  # level 2: switched to by its tab, in English
            page.click(f"#level-{level}")
            expect(page.locator("#title")).to_have_text(quiz.title(lang))
            expect(page.locator(f"#level-{level}")).to_have_attribute("aria-selected", "true")
            expect(page.locator(".question")).to_have_count(8)
            wrong = _answer_all(page, expect, level, lang, live=True)
            expect(page.locator(".live svg.chart")).not_to_have_count(0)
            for n in range(1, 9):
                assert page.locator(f"#q{n} .live svg.chart").count() >= 1, (level, n)
            assert page.evaluate(OVERFLOW_JS) == [], (level, lang)
            review = page.locator("#review")
            expect(review).to_be_visible()
            expect(review.locator(".missed")).to_have_count(wrong)
            score = quiz.ui(lang)["final"].format(score=8 - wrong, total=8)
            expect(page.locator("#final")).to_have_text(score)
            assert page.locator("body").inner_text().count(score) == 2  # the bar, the end: once
        page.click("#lang-fr")  # level 2 answered in English, now told in French
        expect(page.locator("#q1 .explanation")).to_contain_text(
            quiz.items("fr", 2)[0].explanation[:50])
        expect(page.locator("#score")).to_contain_text("8/8 répondues")
        page.click("#level-1")
        expect(page.locator("#questions .explanation")).to_have_count(8)  # level 1 answers kept
        page.click("#restart")
        expect(page.locator(".explanation")).to_have_count(0)
        expect(page.locator("#review")).to_be_hidden()
        browser.close()
    assert errors == []
