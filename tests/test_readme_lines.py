"""The README's command blocks of the quiz, training and planning paths, and the layouts of
docs/training.md's "3D training", run as pasted, one
line after another, in one fresh folder (a new user's first minutes): through the CLI's
entry (`tpkit.cli.main`,
what the installed `tpkit` runs; one process, so torch is imported once), with
`--steps 2` on the train lines, `--no-hosts` on the live quiz (its proofs across
simulated hosts have their own test in test_quiz.py), `--compile-backend eager` added
where `--compile` appears (Inductor's C++ code generation takes minutes on a 2-core machine;
benchmarks/compile_speedup.py runs it) and the quiz's eight answers on its stdin. A
line that refuses what an earlier line left (a shared --out) fails here. The live quiz's
line is the suite's run of `quiz --live` through the CLI: a demonstration after each of
its eight answers, its figures in the quiz's language, the score last. The fine-tuning
block runs whole, as pasted, in test_workflow.py (the checks of its outputs beside it)."""

from __future__ import annotations

import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from tpkit.cli import main

ROOT = Path(__file__).resolve().parents[1]


PATHS = (("README.md", "## Learn with the quiz"), ("README.md", "## Train"),
         ("docs/training.md", "## 3D training"), ("README.md", "## Plan"))  # in order


def what_you_can_do() -> list[str]:
    """The command lines of the first bash block of each of the sections `PATHS` names."""
    lines = []
    for doc, heading in PATHS:
        text = (ROOT / doc).read_text()
        section = text[text.index(f"\n{heading}\n"):]
        block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
        lines += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    return lines


def reduced(line: str) -> list[str]:
    """The arguments a line gives tpkit here: fewer steps, the cheaper backend."""
    argv = shlex.split(line)
    assert argv[0] == ".venv/bin/tpkit", f"the block should only hold tpkit lines: {line!r}"
    argv = argv[1:]
    if argv[:1] == ["quiz"] and "--live" in argv:
        argv += ["--no-hosts"]  # the simulated hosts' proofs: test_quiz's own test, as root
    if argv[0] == "train":
        if "--steps" in argv:
            argv[argv.index("--steps") + 1] = "2"
        else:
            argv += ["--steps", "2"]
        if "--compile" in argv:
            argv += ["--compile-backend", "eager"]  # Dynamo traces, no AOT: a third less time
    return argv


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_line_of_what_you_can_do_runs_one_after_another(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    lines = what_you_can_do()
    assert sum(" train " in f" {s} " for s in lines) >= 5
    outs = [s.split("--out ")[1].split()[0] for s in lines if "--out " in s]
    assert len(outs) == len(set(outs)), f"two train lines share an --out: {outs}"
    for line in lines:
        monkeypatch.setattr(sys, "stdin", io.StringIO("1\n" * 8))  # the quiz's answers
        code = main(reduced(line))
        out, err = capsys.readouterr()
        assert code == 0, f"{line}\n{err[-3000:]}"
        if "--live" in line:
            shows_a_demonstration_after_each_answer(reduced(line), out)


def shows_a_demonstration_after_each_answer(argv: list[str], out: str) -> None:
    """The live quiz's output: eight demonstrations, each after its answer, with figures
    measured against tp=1 and the communication log, in the quiz's language (French
    here); the score last."""
    from tpkit.quiz.content import load_quiz

    assert argv[argv.index("--lang") + 1] == "fr", argv
    ui = load_quiz().ui("fr")
    parts = out.split(f"--- {ui['live']} ---\n")
    assert len(parts) == 9, out[-3000:]  # eight demonstrations
    assert all(p.split("\n\n")[0].strip() for p in parts[1:]), out[-3000:]  # none blank
    assert all(f"Question {n}/8" in parts[n - 1] for n in range(1, 9)), out[-3000:]
    assert "écart max = " in out and "all-gather en passe avant" in out, out[-3000:]
    assert re.fullmatch(ui["score_line"].format(score=r"\d", total=8),
                        out.splitlines()[-1]), out[-300:]
