"""The README's "What has run where" stays true: its table is read, and each row's claim is
checked against the repository.

- Every row names evidence that exists: a file (`tests/...`, `benchmarks/...`,
  `src/...`, `Makefile`) or a section of a doc (`docs/X.md "Title"`: a heading of X
  starts with Title).
- Every ratio or percentage a row quotes appears in the docs section it cites.
- "every `make test`": the Makefile's test target runs pytest, and the test files named
  start processes and use both transports the row names (shared memory, gloo).
- "ran once, DATE": the benchmarks' history (docs/benchmarks_history.md) records exactly
  one run of the row's kind (one GPU, or several if the row says so), that day.
- "written, never run": no section of the history records a run on several GPUs
  or on NCCL, no test or benchmark asks for the nccl backend, and the code named has it.
- "simulated on one machine": each test named starts two torchrun agents (`--nnodes 2`);
  the row says loopback if and only if one of them runs on 127.0.0.1, network
  namespaces if and only if one runs them on simulated hosts (`tpkit cluster`), and restarts
  (`--max-restarts`) if and only if a test named restarts them.
- "measured on CPU only": the sections cited measured llama.cpp's server (`llama-server`).
And docs/serving.md's and docs/benchmarks.md's lists of sources name sections of the
history that exist.
`test_the_check_catches_rows_that_lie` shows each check failing on a lying row.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = re.compile(r"^(#+) (.*)$", re.M)
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:x|%)")  # 1.31x, 17.1%
HISTORY = "docs/benchmarks_history.md"  # the dated notebook behind every figure
SECTION = re.compile(r'(docs/[\w/]+\.md) "([^"]+)"')
FILE = re.compile(r"`((?:tests|benchmarks|src)/[\w/.]+|Makefile)`")
GPU_RUN = re.compile(r"^#+ .*\b(?:GPUs?|H100|H200|A100|B200)\b.*\d{4}-\d{2}-\d{2}", re.M)
SEVERAL_GPUS = re.compile(r"\bGPUs\b|NCCL|multi-GPU|\bH100s\b", re.I)
SIMULATED_HOSTS = re.compile(r'"cluster", "run"|\bip netns\b|"unshare"')  # tpkit cluster
NCCL_ASKED = re.compile(r"""backend\s*=\s*["']nccl|init_process_group\(\s*["']nccl""")


def table(readme: str) -> dict[str, dict[str, str]]:
    """The rows of the README's "What has run where" table, by their first cell."""
    section = readme.split("\n## What has run where\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    return {cells[0]: dict(zip(head, cells))
            for line in rows[2:] for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def section_text(doc: str, title: str) -> str | None:
    """The text of the first section of `doc` whose heading starts with `title` (to the
    next heading of its level or above), None if there is none."""
    text, title = (ROOT / doc).read_text(), " ".join(title.split())
    for m in HEADING.finditer(text):
        if m.group(2).startswith(title):
            level = len(m.group(1))
            end = next((n.start() for n in HEADING.finditer(text, m.end())
                        if len(n.group(1)) <= level), len(text))
            return text[m.start():end]
    return None


def _evidence(name: str, row: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(problems, the named files' texts, the cited sections' texts) of one row."""
    out, files, sections = [], [], []
    for path in FILE.findall(row["Evidence"]):
        if (ROOT / path).is_file():
            files.append((ROOT / path).read_text())
        else:
            out.append(f"{name}: {path} does not exist")
    for doc, title in SECTION.findall(row["Evidence"]):
        text = section_text(doc, title)
        if text is None:
            out.append(f'{name}: {doc} has no section "{title}"')
        else:
            sections.append(text)
    if not files and not sections:
        out.append(f"{name}: names no evidence")
    return out, files, sections


def _figures(name: str, row: dict[str, str], sections: list[str]) -> list[str]:
    said = " ".join(sections)
    return [f"{name}: {f} is not in the sections it cites"
            for f in FIGURE.findall(row["How it was checked"]) if f not in said]


def _status(name: str, row: dict[str, str], files: list[str], sections: list[str]) -> list[str]:
    status, text = row["Status"], " ".join(row.values())
    bench = (ROOT / HISTORY).read_text()
    runs = GPU_RUN.findall(bench)
    if status == "every `make test`":
        make = (ROOT / "Makefile").read_text()
        code = " ".join(files)
        ok = re.search(r"^test:.*\n\t.*pytest", make, re.M) and "gloo" in code and \
            "shm" in code and re.search(r"\b(run_tp|spawn|WorkerPool)\b", code)
        return [] if ok else [f"{name}: the files named do not run the suite's processes "
                              f"on shared memory and gloo"]
    if status.startswith("ran once, "):  # on one GPU, or on several if the row says so
        day = status.removeprefix("ran once, ")
        mine = [r for r in runs if bool(SEVERAL_GPUS.search(r)) == ("Several" in name)]
        ok = len(mine) == 1 and day in mine[0]
        return [] if ok else [f"{name}: {HISTORY} records these GPU runs: {runs}"]
    if status == "written, never run":
        asked = [p.name for p in (*ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"))
                 if NCCL_ASKED.search(p.read_text())]
        out = [f"{name}: {HISTORY} records {r!r}" for r in runs
               if SEVERAL_GPUS.search(r)]
        out += [f"{name}: {f} asks for nccl" for f in asked]
        if not any("nccl" in f for f in files):
            out.append(f"{name}: the code named has no nccl path")
        return out
    if status == "simulated on one machine":  # each test named: two agents
        loopback = any("127.0.0.1" in f for f in files)
        netns = any(SIMULATED_HOSTS.search(f) for f in files)
        ok = all('"--nnodes", "2"' in f for f in files) and ("loopback" in text) == loopback \
            and ("network namespaces" in text) == netns and \
            ("--max-restarts" in text) == any('"--max-restarts"' in f for f in files)
        return [] if ok else [f"{name}: the tests named do not run two agents over loopback "
                              f"(or restart them) as the row says"]
    if status == "measured on CPU only":
        ok = sections and all("llama-server" in s for s in sections)
        return [] if ok else [f"{name}: the sections cited did not measure llama-server"]
    return [f"{name}: unknown status {status!r}"]


def problems(readme: str) -> list[str]:
    """What the README's table claims that the repository does not bear out."""
    rows = table(readme)
    wanted = ("CPU", "One GPU", "Several GPUs", "Several hosts", "llama.cpp")
    out = [f"no row for {w}" for w in wanted if not any(w in name for name in rows)]
    for name, row in rows.items():
        found, files, sections = _evidence(name, row)
        out += found + _figures(name, row, sections) + _status(name, row, files, sections)
    return out


def test_the_readme_table_is_true():
    assert problems((ROOT / "README.md").read_text()) == []


def test_the_check_catches_rows_that_lie():
    readme = (ROOT / "README.md").read_text()
    lies = {
        "| written, never run |": "| ran once, 2026-11-29 |",
        "`tests/test_two_node.py`": "`tests/test_three_node.py`",
        "on one host over loopback (127.0.0.1)": "on two hosts over their network",
        "float32 1.31x llama.cpp": "float32 1.91x llama.cpp",
        '"One GPU"': '"Two GPUs"',
        "`tests/test_shm.py`, ": "",
        ", `tests/test_two_hosts.py`": "",
    }
    found = problems(readme)
    assert found == []
    for old, new in lies.items():
        assert old in readme, old
        said = problems(readme.replace(old, new, 1))
        assert len(said) >= 1, (old, new)
    said = problems(readme.replace("| written, never run |", "| ran once, 2026-11-29 |"))
    assert any("Several GPUs" in s and "records these GPU runs" in s for s in said), said
    said = problems(readme.replace("float32 1.31x llama.cpp", "float32 1.91x llama.cpp"))
    assert said == ["`tpkit serve` against llama.cpp: 1.91x is not in the sections it cites"]


def test_the_current_results_are_in_the_sections_they_cite():
    """docs/benchmarks.md's current results: each figure is in the sections of the history
    its row names, and each subject's table comes with the command that reproduces it."""
    top = (ROOT / "docs" / "benchmarks.md").read_text().split("\n## ", 2)[1]
    rows = [r for r in top.splitlines() if r.startswith("| ") and '"' in r]
    assert len(rows) >= 8
    for row in rows:
        figure = row.strip("|").split("|")[1]
        said = " ".join(section_text(HISTORY, t) or ""
                        for t in re.findall(r'"([^"]+)"', row))
        missing = [f for f in re.findall(r"\d+\.\d+", figure) if f not in said]
        assert missing == [], (row, missing)
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert re.findall(r"^## (.*)", page, re.M) == [
        "Current results", "What has never run", "How the figures are measured"], \
        "a dated section belongs at the end of docs/benchmarks_history.md"
    tables = top.split("\n### ")[1:]  # a table per subject, each with its command
    assert len(tables) >= 4
    for table in tables:
        assert "\n| subject |" in table and "```bash\n" in table, table[:200]


def test_the_sources_named_in_the_docs_exist():
    serving = (ROOT / "docs" / "serving.md").read_text()
    where = serving.split("Where each figure was measured", 1)[1].split("\n\n", 1)[0]
    top = (ROOT / "docs" / "benchmarks.md").read_text().split("\n## ", 2)[1]
    titles = re.findall(r'"([^"]+)"', where) + re.findall(r'\| "([^"]+)"', top)
    assert len(titles) >= 12
    missing = [t for t in titles if section_text(HISTORY, t) is None]
    assert missing == []
