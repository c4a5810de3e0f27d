"""The web tutor: only the page's files on 127.0.0.1, the JSON endpoint, and a real browser.

The browser test drives Debian's chromium with Playwright: it answers all 8 questions,
sees each explanation appear, switches language mid-quiz, and checks the final score.
It fails (never skips) when chromium or playwright is missing: `make browser` installs them.
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading

import pytest

from tpkit.quiz.content import load_quiz
from tpkit.quiz.web import make_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _serve(live=None):
    server = make_server(load_quiz(), port=0, lang="fr", live=live)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def server():
    calls = []

    def fake_live(number: int, tp: int, lang: str) -> dict:  # the web layer only
        calls.append((number, tp, lang))
        return {"text": f"demo {number} at tp={tp} ({lang})", "tp": tp}

    srv = _serve(fake_live)
    srv.calls = calls
    yield srv
    srv.shutdown()
    srv.server_close()


def get(server, path: str, host: str | None = None, method: str = "GET"):
    port = server.server_address[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, headers={"Host": host or f"127.0.0.1:{port}"})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, resp.getheader("Content-Type"), body


def test_binds_to_loopback_only(server):
    assert server.server_address[0] == "127.0.0.1"


@pytest.mark.parametrize("path", ["/", "/index.html", "/app.js", "/style.css"])
def test_page_files_are_served(server, path):
    status, ctype, body = get(server, path)
    assert status == 200 and body
    assert ctype.split(";")[0] in ("text/html", "text/javascript", "text/css")


@pytest.mark.parametrize("path", ["/../questions.json", "/questions.json", "/web/app.js",
                                  "/%2e%2e/content.py", "/..%2f..%2fpyproject.toml",
                                  "/app.js/../../cli.py", "//etc/passwd", "/content.py"])
def test_nothing_else_is_served(server, path):
    status, _, body = get(server, path)
    assert status == 404, (path, body[:80])


def test_foreign_host_header_is_refused(server):
    assert get(server, "/", host="evil.example:80")[0] == 403


def test_quiz_endpoint_has_both_languages(server):
    status, ctype, body = get(server, "/api/quiz")
    data = json.loads(body)
    assert status == 200 and ctype == "application/json"
    assert data["languages"] == ["fr", "en"] and data["default_lang"] == "fr"
    assert len(data["questions"]) == 8 and data["live"] is True


def test_live_endpoint_is_bounded(server):
    status, _, body = get(server, "/api/live/3?tp=4")
    assert status == 200 and json.loads(body)["text"] == "demo 3 at tp=4 (fr)"  # server's lang
    assert get(server, "/api/live/3?tp=4&lang=fr")[0] == 200
    assert server.calls == [(3, 4, "fr")]  # cached
    assert json.loads(get(server, "/api/live/3?tp=4&lang=en")[2])["text"] == "demo 3 at tp=4 (en)"
    assert server.calls == [(3, 4, "fr"), (3, 4, "en")]
    assert get(server, "/api/live/9")[0] == 404
    assert get(server, "/api/live/1?tp=3")[0] == 400
    assert get(server, "/api/live/1?tp=2x")[0] == 400
    assert get(server, "/api/live/1?lang=de")[0] == 400


@pytest.mark.timeout(120)
def test_live_endpoint_tells_real_demonstrations_in_the_language_asked(pools):
    from tpkit.quiz.live import LiveSession

    srv = _serve(LiveSession(runner=pools.run).run)
    try:
        fr = json.loads(get(srv, "/api/live/7?tp=2&lang=fr")[2])
        en = json.loads(get(srv, "/api/live/7?tp=2&lang=en")[2])
        assert "découpée par lignes sur tp=2 rangs" in fr["text"] and "écart max" in fr["text"]
        assert "split by rows over tp=2" in en["text"] and "max |diff|" in en["text"]
        assert fr["weight_per_rank"] == en["weight_per_rank"] == [[16, 32], [16, 32]]
    finally:
        srv.shutdown()
        srv.server_close()


def test_live_endpoint_absent_without_live():
    srv = _serve(None)
    try:
        assert get(srv, "/api/live/1")[0] == 404
        assert json.loads(get(srv, "/api/quiz")[2])["live"] is False
    finally:
        srv.shutdown()
        srv.server_close()


def _sync_api():
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: `pip install -e '.[web]'` (see `make test`)")
    return expect, sync_playwright


def _browser(playwright):
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} not found: the browser test needs Debian's chromium "
                    f"(run `make browser`, or `apt-get install chromium`)")
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


@pytest.mark.timeout(90)
def test_browser_answers_all_questions_switches_language_and_scores(server):
    expect, sync_playwright = _sync_api()
    quiz = load_quiz()
    fr, en = quiz.items("fr"), quiz.items("en")
    choices = [0, 0, 2, 3, 1, 1, 2, 0]  # questions 2, 5 and 8 wrong: 5/8
    url = f"http://127.0.0.1:{server.server_address[1]}/?lang=fr"
    with sync_playwright() as p:
        browser = _browser(p)
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        expect(page.locator("#title")).to_have_text(quiz.title("fr"))
        expect(page.locator(".question")).to_have_count(8)
        expect(page.locator("#q2 svg")).to_contain_text("A : par colonnes")
        expect(page.locator("#q6 svg")).to_contain_text("rang 7")
        for i, k in enumerate(choices):
            items = fr if i < 4 else en
            section = page.locator(f"#q{i + 1}")
            expect(section.locator("svg.diagram")).to_have_count(1)
            expect(section.locator(".explanation")).to_have_count(0)  # not before answering
            section.locator(".option").nth(k).click()
            expect(section.locator(".explanation")).to_contain_text(items[i].explanation)
            verdict = "right" if k == items[i].correct else "wrong"
            expect(section.locator(f".verdict.{verdict}")).to_have_count(1)
            expect(section.locator(".option.right")).to_have_text(
                f"{items[i].correct + 1}.{items[i].options[items[i].correct]}")
            if i == 0:  # the live panel asks for the page's language
                section.locator(".live button").click()
                expect(section.locator(".live pre")).to_have_text("demo 1 at tp=2 (fr)")
            if i == 3:  # halfway: switch to English, answers and explanations stay
                expect(page.locator("#score")).to_contain_text("Score : 3/8")
                page.click("#lang-en")
                expect(page.locator("html")).to_have_attribute("lang", "en")
                expect(page.locator("#title")).to_have_text(quiz.title("en"))
                expect(page.locator("#q1 .explanation")).to_contain_text(en[0].explanation)
                expect(page.locator(".explanation")).to_have_count(4)
                expect(page.locator("#q2 svg")).to_contain_text("B: rows")
                expect(page.locator("#q4 svg")).to_contain_text("Q,K,V: columns · out: rows")
        expect(page.locator("#final")).to_be_visible()
        expect(page.locator("#final")).to_contain_text("Score: 5/8")
        expect(page.locator("#score")).to_contain_text("Score: 5/8")
        page.click("#lang-fr")
        expect(page.locator("#final")).to_contain_text("Score : 5/8")
        page.click("#restart")
        expect(page.locator(".explanation")).to_have_count(0)
        expect(page.locator("#final")).to_be_hidden()
        browser.close()
    assert errors == []


@pytest.mark.timeout(120)
def test_cli_web_live_serves_real_demonstrations_to_the_browser():
    import signal
    import subprocess
    import sys

    expect, sync_playwright = _sync_api()
    code = "import sys; from tpkit.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "quiz", "--web", "--live", "--port", "0",
                             "--lang", "en"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, line
        url = line.split()[2]
        with sync_playwright() as p:
            browser = _browser(p)
            page = browser.new_page()
            page.goto(url)
            page.locator("#q2 .option").nth(1).click()
            page.locator("#q2 .live button").click()
            expect(page.locator("#q2 .live pre")).to_contain_text("all_reduce forward",
                                                                  timeout=60_000)
            expect(page.locator("#q2 .live pre")).to_contain_text("tp=2")
            browser.close()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
