"""The first hour of a new user, through the real CLI: what a command says must be true
and read in the user's terms.

Checked: counts read '1 prompt', '8 micro-batches'; an unknown preset gets the nearest
names; a tp the model refuses is one line naming it once and the tp sizes that work.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpkit.cli import main
from tpkit.spec.words import number_ranges, plural, suggest

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           PYTHONUNBUFFERED="1")
SEED_ANSWERS = "1,2,3,4,1,2,3,4"  # the seed quiz's right options, numbered as it lists them


def _tpkit(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpkit", *argv], capture_output=True,
                          text=True, env=ENV, timeout=300, **kw)


# -- 6. plurals, 8. did you mean a preset, 9. a tp the model refuses ------------------------
def test_plural_and_number_ranges():
    assert [plural(1, "prompt"), plural(2, "micro-batch"), plural(0, "process"),
            plural(12345, "token", fmt=",")] == \
        ["1 prompt", "2 micro-batches", "0 processes", "12,345 tokens"]
    assert number_ranges([8, 1, 2, 3, 4, 6]) == "1-4, 6, 8" and number_ranges([1, 2]) == "1, 2"
    assert suggest("--lrr", ["--lr", "--seed"]) == "; did you mean --lr?"


@pytest.mark.parametrize("command", ["train", "plan"])
def test_unknown_preset_names_the_nearest(command, capsys):
    extra = ["--nodes", "1", "--gpus-per-node", "8", "--hardware", "h100"] * (command == "plan")
    assert main([command, "--preset", "gpt2-tinyy", *extra]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "unknown preset 'gpt2-tinyy'; did you mean gpt2-tiny" in err[0]


def test_a_refused_tp_names_the_model_once_and_the_tp_that_work(capsys):
    from tpkit.spec import get_preset

    model = get_preset("gpt2-tiny")
    bad = next(t for t in range(2, 9) if model.problems(tp=t))
    works = [t for t in range(1, model.num_heads + 1) if not model.problems(tp=t)]
    assert main(["train", "--preset", "gpt2-tiny", "--tp", str(bad), "--steps", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].count("gpt2-tiny:") == 1, err
    assert err[0].endswith(f"(the tp sizes that work: {number_ranges(works)})"), err
