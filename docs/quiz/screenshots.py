"""Take the quiz screenshots of docs/quiz/ (fr and en, desktop and phone).

    PYTHONPATH=src .venv/bin/python docs/quiz/screenshots.py [OUT_DIR]

Starts the web tutor with real live demonstrations on local CPU processes, drives
Debian's chromium with Playwright, and writes small PNGs: one question before and after
answering, a chart demonstration, and the review page.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from playwright.sync_api import sync_playwright

from tpkit.quiz.content import load_quiz
from tpkit.quiz.live import LiveSession
from tpkit.quiz.web import make_server

SIZES = {"desktop": dict(width=1280, height=900), "phone": dict(width=390, height=844)}
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


def shoot(page, url: str, out: Path, tag: str) -> None:
    """Question 2 before/after, its live charts, then the review (two questions missed)."""
    quiz = load_quiz()
    page.goto(url)
    q = page.locator("#q2")
    q.screenshot(path=out / f"{tag}-1-before.png")
    q.locator(".option").first.click()
    q.locator(".feedback").wait_for()
    q.screenshot(path=out / f"{tag}-2-after.png")
    q.locator(".live button").click()
    q.locator(".live figure").first.wait_for(timeout=120_000)
    q.locator(".live").screenshot(path=out / f"{tag}-3-chart.png")
    for n in (1, 3, 4, 5, 6, 7, 8):  # question 2 is answered above; 7 is missed too
        right = quiz.questions(1)[n - 1]["answer"]
        pick = f"[data-index='{right}']" if n != 7 else f":not([data-index='{right}'])"
        page.locator(f"#q{n} .option{pick}").first.click()
        page.locator(f"#q{n} .feedback").wait_for()
    page.locator("#review").wait_for()
    page.locator("#review").screenshot(path=out / f"{tag}-4-review.png")


def shrink(folder: Path) -> None:
    """Re-encode the PNGs with a 64-colour palette (a third of the size), if Pillow is here."""
    try:
        from PIL import Image
    except ImportError:
        return
    for png in folder.glob("*.png"):
        Image.open(png).convert("RGB").quantize(64).save(png, optimize=True)


def main(out: Path) -> None:
    session = LiveSession()
    server = make_server(load_quiz(), port=0, lang="en",
                         live=lambda level, n, tp, lang: session.run(n, tp, lang, level))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/?seed=7"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            for device, size in SIZES.items():
                for lang in ("fr", "en"):
                    page = browser.new_page(viewport=size)
                    shoot(page, f"{base}&lang={lang}", out, f"{lang}-{device}")
                    page.close()
            browser.close()
    finally:
        server.shutdown()
        session.close()
    shrink(out)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent))
