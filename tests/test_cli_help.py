"""A command line that explains itself: every flag of every command has a help text that
states its default (choices as {a,b,c}), grouped under headings; a misspelt command,
flag or choice gets the close match; `--version` and `tpkit version` answer;
`tpkit train --print-config` prints the effective config."""

from __future__ import annotations

import argparse

import pytest

from tpkit.cli import COMMANDS, command_parser, main
from tpkit.commands.common import HelpFormatter
from tpkit.train.config import SECTIONS


def _parser(name: str) -> argparse.ArgumentParser:
    return command_parser(name)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_has_help_and_shows_its_default(name):
    parser = _parser(name)
    formatter = HelpFormatter(parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue  # --help, and the old spellings --help does not show
        what = f"tpkit {name} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help.strip(), f"{what} has no help text"
        text = formatter._get_help_string(action) % dict(vars(action), prog=parser.prog)
        assert "one of (" not in text and "('" not in text, f"{what}: choices as a tuple: {text}"
        if action.option_strings and action.nargs != 0 and not action.required:
            assert "default" in text.lower(), f"{what} does not show its default: {text!r}"
        if action.choices is not None:
            assert "{" in formatter._format_args(action, action.dest), f"{what}: hidden choices"


def test_train_help_is_grouped_under_the_headings(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    at = [out.index(f"\n{h}:\n") for h in SECTIONS]  # a heading per [section] of a file
    assert at == sorted(at), "headings out of order"
    section = out[out.index("\nparallelism:\n"):out.index("\ntraining:\n")]
    assert "--tp N" in section and "(default: 1)" in section and "--global-batch" not in section
    assert "--schedule {gpipe,1f1b,interleaved}" in section


@pytest.mark.parametrize("argv, hint", [
    (["trian"], "did you mean train?"),
    (["train", "--lrr", "3"], "did you mean --lr?"),
    (["train", "--schedule", "gpip"], "did you mean gpipe?"),
    (["generate", "--checkpoint", "x", "--max-new-tokns", "3"], "did you mean --max-new-tokens?"),
])
def test_a_close_misspelling_gets_a_suggestion(argv, hint, capsys):
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip()
    assert status == 2 and hint in err and len(err.splitlines()) == 1, err


def test_version(capsys):
    from importlib import metadata

    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"tpkit {metadata.version('tpkit')} (torch {metadata.version('torch')}")
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert "transports:" in out and "gloo           available" in out
    assert "\n  shm            " in out and "\n  nccl           " in out
    assert f"transformers   {metadata.version('transformers')}" in out
    import torch

    assert f"fast paths:\n  cpu            {torch.backends.cpu.get_cpu_capability()} " in out


def test_version_reads_the_low_precision_flags_of_the_cpu(tmp_path, monkeypatch):
    from tpkit.commands import version
    from tpkit.host import device

    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f "
                                      "avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert device.cpu_flags(tmp_path / "cpuinfo") == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert device.cpu_flags(tmp_path / "none") == set()
    import torch

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    for flags, bf16, fp16 in (({"avx512_bf16"}, True, False), ({"amx_tile"}, False, False),
                              ({"amx_tile", "amx_bf16", "amx_fp16"}, True, True)):
        monkeypatch.setattr(device, "cpu_flags", lambda f=flags: f)
        state = dict(version.fast_paths())
        assert state["bfloat16"].startswith("accelerated") == bf16, (flags, state)
        assert state["float16"].startswith("accelerated") == fp16, (flags, state)
    assert state["cuda"] == "none" or "bfloat16" in state["cuda"]


def test_print_config_merges_defaults_file_and_flags(tmp_path, capsys):
    from tpkit.train.config import TrainConfig

    toml = tmp_path / "run.toml"
    toml.write_text('[parallelism]\ntp = 2\n[optimizer]\nlr = 1e-3\nwarmup = 4\n')
    assert main(["train", "--config", str(toml), "--warmup", "2", "--print-config"]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    cfg = TrainConfig.from_toml(printed)
    assert cfg == TrainConfig(tp=2, lr=1e-3, warmup=2)  # the flag over the file over defaults
    assert not (tmp_path / "runs").exists()


def test_version_and_help_import_no_torch():
    import subprocess
    import sys

    code = ("import sys; from tpkit.cli import main; main(['--version']); main(['--help']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("tpkit "), r.stderr
