"""docs/cookbook.md runs as written: every ```bash and ```python block, in order, in a
fresh folder (`.venv/bin/tpkit ...` lines through the real CLI entry `tpkit.cli.main`,
`.venv/bin/python tests/...` lines as that script, Python blocks as code). Then checked: the JSONL file's
documents are in index.json, the tp=2 run and its resume with a new learning rate have
one metrics row and one TensorBoard loss point per step, the resume named its changes,
the run folder keeps the new config, and the export is a folder transformers loads."""

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
    assert json.loads(Path("data/index.json").read_text())["documents"] == len(lines)
    assert "bytes in the tp group at the last step" in said[3].out
    assert "with changes: steps: 6 -> 10; lr: 0.01 -> 0.003" in said[4].err
    rows = [json.loads(r) for r in Path("run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[-1]["lr"] < 3e-3

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator("run/tb")
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 11))
    assert 'lr = 0.003' in Path("run/config.toml").read_text()
    assert (Path("export") / "config.json").is_file() and Path("resharded").is_dir()
    assert said[6].out.startswith("Tensor parallelism splits")
