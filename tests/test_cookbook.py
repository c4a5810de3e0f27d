"""docs/cookbook.md runs as written: every ```bash and ```python block, in order, in a
fresh folder (`.venv/bin/tpkit ...` lines through the real CLI entry `tpkit.cli.main`,
`.venv/bin/python tests/...` lines as that script, Python blocks as code). Then checked: the JSONL file's
documents are in index.json, the tp=2 run and its resume with a new learning rate have
one metrics row and one TensorBoard loss point per step, the resume named its changes,
the run folder keeps the new config, the export is a folder transformers loads, and
`tpkit generate` prints text after the prompt (not blanks), the very text transformers
prints. Every folder it writes is the cookbook's own (`notes-*`): none of the README's
nor docs/training.md's."""

from __future__ import annotations

import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from tpkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```(bash|python)\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block of the cookbook, in order."""
    return BLOCK.findall((ROOT / "docs" / "cookbook.md").read_text())


def written(text: str) -> set[str]:
    """The folders a text's command lines write: `--out X` and `convert SRC X`."""
    return set(re.findall(r"--out (\S+)", text)) | \
        set(re.findall(r"tpkit convert \S+ (\S+)", text))


def _run_line(line: str, monkeypatch) -> None:
    argv = shlex.split(line)
    if argv[0] == ".venv/bin/tpkit":
        assert main(argv[1:]) == 0, line
    elif argv[0] == ".venv/bin/python" and argv[1].startswith("tests/"):
        monkeypatch.setattr(sys, "argv", [str(ROOT / argv[1]), *argv[2:]])
        runpy.run_path(str(ROOT / argv[1]), run_name="__main__")
    else:
        raise AssertionError(f"the cookbook test cannot run {line!r}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_block_of_the_cookbook_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert [lang for lang, _ in blocks()] == ["bash", "python", "bash", "python", "bash",
                                              "bash", "python"]
    said = []
    for lang, code in blocks():
        if lang == "python":
            exec(compile(code, "cookbook.md", "exec"), {"__name__": "__cookbook__"})
        else:
            for line in filter(None, (s.strip() for s in code.splitlines())):
                _run_line(line, monkeypatch)
        said.append(capsys.readouterr())
    lines = [s for s in Path("corpus.txt").read_text().splitlines() if s.strip()]
    assert json.loads(Path("notes-data/index.json").read_text())["documents"] == len(lines)
    assert "bytes in the tp group at the last step" in said[3].out
    assert "with changes: steps: 100 -> 200; lr: 0.01 -> 0.003" in said[4].err
    rows = [json.loads(r) for r in Path("notes-run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 201)) and rows[-1]["lr"] < 3e-3

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator("notes-run/tb")
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 201))
    assert 'lr = 0.003' in Path("notes-run/config.toml").read_text()
    assert (Path("notes-export") / "config.json").is_file() and Path("notes-tp1").is_dir()
    prompt = "Tensor parallelism splits"
    ours = next(s for s in said[5].out.splitlines() if s.startswith(prompt))
    assert ours.removeprefix(prompt).strip(), f"generate printed blanks: {ours!r}"
    assert said[6].out.strip() == ours.strip()  # transformers, greedy: the same text
    ours = written("".join(code for _, code in blocks()))
    theirs = written((ROOT / "README.md").read_text() + (ROOT / "docs" / "training.md").read_text())
    assert len(ours) == 4 and not ours & theirs, f"the README or training.md writes these too: {ours & theirs}"
