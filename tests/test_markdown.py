"""The README and every doc render as written (CommonMark, by markdown-it-py): each code
fence closes where it was meant to, no fence-looking line hides inside a code block (a
closing fence with text after it does not close: the prose after it, and the headings,
rendered as code once), and every line written as a heading is a heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
HEADING = re.compile(r"^#{1,6} ")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def problems(text: str) -> list[str]:
    """What renders otherwise than written, one line each (1-based line numbers)."""
    lines = text.splitlines()
    tokens = MarkdownIt("commonmark").parse(text)
    out, in_code = [], set()
    for t in tokens:
        if t.type == "fence":
            start, end = t.map
            in_code.update(range(start, end))
            if not FENCE.match(lines[end - 1]) or end - 1 == start:
                out.append(f"line {start + 1}: the code fence never closes")
            for i in range(start + 1, end - 1):
                if FENCE.match(lines[i]):
                    out.append(f"line {i + 1}: a fence inside the code block of line "
                               f"{start + 1} (text after a closing fence?)")
        elif t.type == "code_block":
            in_code.update(range(*t.map))
    headings = {t.map[0] for t in tokens if t.type == "heading_open"}
    for i, line in enumerate(lines):
        if HEADING.match(line) and i not in headings and i not in in_code:
            out.append(f"line {i + 1}: {line!r} is not rendered as a heading")
    return out


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_renders_as_written(path):
    assert problems(path.read_text()) == []


def test_the_check_sees_a_closing_fence_with_text_after_it():
    broken = "# Title\n\n```bash\nls\n``` Then prose\n\n## Next\n\ntext\n\n```python\nx = 1\n```\n"
    found = problems(broken)
    assert any("line 5: a fence inside" in p for p in found), found
    assert problems("# Title\n\n```bash\nls\n") == ["line 3: the code fence never closes"]
    assert problems("#Title\n\n##  Sub\n") == []  # '#Title' is a paragraph, as written
    assert problems("text\n    # indented\n") == []
    assert problems(broken.replace("``` Then prose", "```\n\nThen prose")) == []
