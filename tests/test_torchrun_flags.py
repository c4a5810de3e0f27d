"""`torchrun ... -m tpkit train <flags>`: torchrun's parser reads abbreviations of its own
options anywhere on the line (`--log` could match --log-dir, --logs-specs: "ambiguous
option", before tpkit starts), so no flag of a command that runs under torchrun may be
the start of one of torchrun's options. Checked against torch's own parser."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from tpkit.cli import command_parser

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "training.md"  # its torchrun line
UNDER_TORCHRUN = ("train", "generate", "serve")  # the commands that read torchrun's RANK


def _parser(command: str) -> argparse.ArgumentParser:
    return command_parser(command)


def _torchrun(argv: list[str], capsys) -> list[str]:
    """What torchrun passes to the script, or the error it stops with."""
    try:
        return get_args_parser().parse_args(argv).training_script_args
    except SystemExit:
        return [capsys.readouterr().err.strip().splitlines()[-1]]


@pytest.mark.parametrize("command", UNDER_TORCHRUN)
def test_no_flag_is_the_start_of_a_torchrun_option(command, capsys):
    theirs = [o for a in get_args_parser()._actions for o in a.option_strings]
    actions = _parser(command)._actions
    flags = [o for a in actions if not _deprecated(a) for o in a.option_strings]
    clashes = {f: [o for o in theirs if o.startswith(f)] for f in flags if f not in ("-h", "--help")}
    assert {f: c for f, c in clashes.items() if c} == {}, "torchrun would read these"
    for flag in flags:
        line = ["--nnodes", "2", "--nproc_per_node", "2", "-m", "tpkit", command, flag, "1"]
        assert _torchrun(line, capsys) == [command, flag, "1"]
    for flag in [o for a in actions if _deprecated(a) for o in a.option_strings]:
        # an old spelling kept for tpkit's own parser: torchrun stops on it, never
        # misreads it as one of its options
        line = ["--nnodes", "2", "--nproc_per_node", "2", "-m", "tpkit", command, flag, "1"]
        assert "ambiguous option" in _torchrun(line, capsys)[0], flag


def _deprecated(action: argparse.Action) -> bool:
    return action.help == argparse.SUPPRESS and hasattr(action, "new")


def test_the_guides_torchrun_line_takes_every_logging_flag(capsys):
    line = next(x for x in GUIDE.read_text().splitlines() if x.startswith("torchrun "))
    argv = shlex.split(line)[1:]
    assert argv[-1] == "..." and argv[argv.index("-m") + 1:][:2] == ["tpkit", "train"], line
    parser = _parser("train")
    logging = next(g for g in parser._action_groups if g.title == "logging")
    given: dict[str, object] = {}
    extra: list[str] = []
    for action in [a for a in logging._group_actions if not _deprecated(a)]:
        flag = action.option_strings[-1]
        if action.nargs == 0:
            extra.append(flag)
            given[action.dest] = action.const
        else:
            extra += [flag, f"{action.dest}-value"]
            given[action.dest] = f"{action.dest}-value"
    script = _torchrun(argv[:-1] + extra, capsys)
    assert script[0] == "train", script
    parsed = vars(parser.parse_args(script[1:]))
    assert {k: parsed[k] for k in given} == given
    assert "--trackers" in extra and "--no-progress" in extra
