"""Configs as files people keep: sectioned TOML ([model], [parallelism], ...), flat keys
still read, one clear error for a bad key or section (naming the nearest valid one);
`to_toml` reads back to the same config; the run folder keeps `config.toml`; a resume
names what changed and refuses another model; the examples in examples/ train."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from tpkit.cli import main
from tpkit.spec.errors import UserError
from tpkit.train.config import SECTIONS, TrainConfig
from tpkit.train.config_file import read_toml, resume_changes, to_toml

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_every_field_has_one_section():
    listed = [n for names in SECTIONS.values() for n in names]
    assert sorted(listed) == sorted(f.name for f in fields(TrainConfig)), \
        "add the new TrainConfig field to a section of tpkit.train.config_file.SECTIONS"


def test_sectioned_and_flat_keys_read_alike(tmp_path):
    sectioned, flat = tmp_path / "s.toml", tmp_path / "f.toml"
    sectioned.write_text('[model]\npreset = "llama-tiny"\n[parallelism]\ntp = 2\nzero1 = true\n'
                         '[training]\nmicro-batches = 4\n[optimizer]\nlr = 1e-3\n')
    flat.write_text('preset = "llama-tiny"\ntp = 2\nzero1 = true\nmicro_batches = 4\nlr = 1e-3\n')
    assert TrainConfig.from_toml(sectioned) == TrainConfig.from_toml(flat) == TrainConfig(
        preset="llama-tiny", tp=2, zero1=True, micro_batches=4, lr=1e-3)


@pytest.mark.parametrize("text, message", [
    ("[parallelism]\ntpp = 2\n", "unknown key [parallelism] 'tpp'; did you mean 'tp'?"),
    ("micro_batchez = 4\n", "unknown key 'micro_batchez'; did you mean 'micro_batches'?"),
    ("[optimiser]\nlr = 1e-3\n", "unknown section [optimiser]; did you mean [optimizer]?"),
    ("[model]\nlr = 1e-3\n", "'lr' belongs in [optimizer], not [model]"),
    ("tp = 2\n[parallelism]\ntp = 4\n", "'tp' is given twice"),
    ("tp = \n", "not valid TOML"),
])
def test_a_bad_key_is_one_error_naming_it(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        TrainConfig.from_toml(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_to_toml_reads_back_to_the_same_config(tmp_path):
    cfg = TrainConfig(preset="llama-tiny", tp=2, sp=True, lr=1e-5, min_lr=None,
                      data="some dir/with \"quotes\"", trace=None, collective_timeout=12.5)
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert TrainConfig.from_toml(path) == cfg
    assert "[parallelism]\ntp = 2\n" in path.read_text() and "# min_lr = (unset)" in path.read_text()


def test_resume_names_the_changes_and_refuses_another_model():
    saved = TrainConfig(steps=10, lr=3e-3).to_dict()
    assert resume_changes(saved, TrainConfig(steps=20, lr=1e-3, resume="x")) == \
        ["steps: 10 -> 20", "lr: 0.003 -> 0.001"]
    with pytest.raises(UserError, match="preset='gpt2-tiny', this run has preset='llama-tiny'; "
                                        "another model cannot continue it"):
        resume_changes(saved, TrainConfig(preset="llama-tiny"))
    with pytest.raises(UserError, match="seq=64.*seq=32; the data loader's windows"):
        resume_changes(saved, TrainConfig(seq=32))


@pytest.mark.timeout(120)
def test_the_run_folder_keeps_its_config_and_a_resume_says_what_changed(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--steps", "2", "--seq", "16", "--global-batch", "2", "--warmup", "1",
            "--val-fraction", "0", "--no-progress", "--trackers", "none", "--out", str(out)]
    assert main(argv) == 0
    kept = read_toml(out / "config.toml", TrainConfig)
    assert kept["steps"] == 2 and kept["seq"] == 16 and kept["out"] == str(out)
    capsys.readouterr()
    assert main(argv[:2] + ["3", "--lr", "1e-3", "--resume", str(out)] + argv[3:]) == 0
    err = capsys.readouterr().err
    assert "with changes: steps: 2 -> 3; lr: 0.003 -> 0.001" in err, err
    assert TrainConfig.from_toml(out / "config.toml").lr == 1e-3  # what it ran now
    assert main(argv[:2] + ["4", "--preset", "llama-tiny", "--resume", str(out)] + argv[3:]) == 2
    assert "another model cannot continue it" in capsys.readouterr().err
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def _train_example(mesh, cfg):
    from tpkit.train.loop import train

    return train(cfg, mesh).losses


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_the_examples_train(name, run_tp, tmp_path):
    cfg = TrainConfig.from_toml(EXAMPLES / f"{name}.toml")
    short = cfg.with_(steps=2, seq=32, out=str(tmp_path), progress=False, plot=False,
                      checkpoint=False, eval_every=0, log="none")
    short.check()
    losses = run_tp(_train_example, cfg.tp, short, pp=cfg.pp, dp=cfg.dp)
    assert all(len(r) == 2 and all(x == x for x in r) for r in losses)
