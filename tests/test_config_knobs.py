"""Each knob of `tpkit train` is declared once (`tpkit.spec.knobs`): a knob added
in one place is a flag under its section's heading in --help, a key of that section of a
TOML file and a line of --print-config; a value of the wrong type or out of range is one
line and exit 2 before anything is printed; files written before still read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

import tpkit.commands.train as train_command
from tpkit.cli import main
from tpkit.spec.knobs import COUNT, knobs
from tpkit.train.config import OPTIMIZER, TrainConfig

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class _WithWarmdown(TrainConfig):
    """TrainConfig and one more knob, declared in one place."""

    warmdown: int = OPTIMIZER.knob(0, "steps of linear decay", check=COUNT)


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_a_knob_declared_once_is_a_flag_a_key_and_printed(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(train_command, "TrainConfig", _WithWarmdown)
    assert _status(["train", "--help"]) == 0
    out = capsys.readouterr().out
    optimizer = out[out.index("\noptimizer:\n"):out.index("\ndata:\n")]
    assert "--warmdown N" in optimizer and "steps of linear decay (default: 0)" in optimizer
    toml = tmp_path / "run.toml"
    toml.write_text("[optimizer]\nwarmdown = 7\n")
    for flags, says in [([], "warmdown = 7"), (["--warmdown", "9"], "warmdown = 9")]:
        assert main(["train", "--config", str(toml), *flags, "--print-config"]) == 0
        printed = capsys.readouterr().out
        assert f"\n{says}\n" in printed[printed.index("[optimizer]"):printed.index("[data]")]
    toml.write_text("[model]\nwarmdown = 7\n")
    assert main(["train", "--config", str(toml), "--print-config"]) == 2
    assert "'warmdown' belongs in [optimizer], not [model]" in capsys.readouterr().err
    assert main(["train", "--warmdown", "-1", "--print-config"]) == 2
    assert "warmdown=-1 must be an integer >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("text, says", [
    ('[training]\nsteps = "five"\n', "[training] steps='five' is not an integer"),
    ("[training]\nsteps = 0\n", "steps=0 must be a positive integer"),
    ("[parallelism]\nsp = 1\n", "sp=1 is not true or false"),
    ("[optimizer]\nlr = true\n", "lr=True is not a number"),
    ('[model]\ndtype = "fp16"\n', "dtype='fp16' is not one of ('float32', 'bfloat16')"),
    ('[parallelism]\nschedule = "gpip"\n', "schedule='gpip' is not one of"),
])
def test_print_config_prints_only_what_a_run_accepts(tmp_path, capsys, text, says):
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    assert main(["train", "--config", str(toml), "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("tpkit train: error: ") and says in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_an_integer_for_a_float_knob_is_a_float(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text("[optimizer]\nlr = 1\n[reliability]\ncollective_timeout = 60\n")
    cfg = TrainConfig.from_toml(toml)
    assert (cfg.lr, cfg.collective_timeout) == (1.0, 60.0) and type(cfg.lr) is float
    assert main(["train", "--config", str(toml), "--lr", "0.5", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "\nlr = 0.5\n" in printed and "\ncollective_timeout = 60.0\n" in printed


def test_files_written_before_still_read():
    """A run folder's config.toml as the code before the knobs wrote it, and an example."""
    old = TrainConfig.from_toml(HERE / "old_run_config.toml")
    assert old == TrainConfig(tp=2, pp=2, steps=20, micro_batches=4, global_batch=16, seq=128,
                              out="runs/old", ckpt_every=0)  # its default then
    example = TrainConfig.from_toml(HERE.parent / "examples" / "gpt2-tiny.toml")
    assert (example.tp, example.pp, example.steps, example.log) == (2, 2, 300, "auto")


def test_every_knob_has_a_flag_and_help():
    flags = [k.option for k in knobs(TrainConfig)]
    assert len(set(flags)) == len(flags) and all(k.help for k in knobs(TrainConfig))
    assert "--no-progress" in flags and "--trackers" in flags and "--log" not in flags
