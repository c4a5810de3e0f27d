"""Serving's knobs are declared once (`tpkit.serve.config.ServeConfig`): every flag of
`tpkit serve` (but --checkpoint and --comm) is a knob, `tpkit generate` takes the
sections it shares, a bad value gets the line its declaration says (by its flag on the
command line, by its field from the Python API), and a new knob is one entry: a
repeatable one included. In-process, no model."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from tpkit.cli import command_parser
from tpkit.commands.common import add_knobs, knob_values
from tpkit.serve.config import AT_LEAST_1, GENERATE, ServeConfig, refuse
from tpkit.spec.errors import UserError
from tpkit.spec.knobs import Section, knobs

OWN = {"-h", "--checkpoint", "--comm", "--debug"}  # the commands' own flags


def _flags(command: str) -> set[str]:
    parser = command_parser(command)
    return {a.option_strings[0] for a in parser._actions if a.option_strings} - OWN


def test_every_serve_flag_is_a_knob_and_generate_takes_its_sections():
    declared = knobs(ServeConfig)
    assert _flags("serve") == {k.option for k in declared}
    shared = {k.option for k in declared if k.section in GENERATE}
    assert {"--tp", "--max-batch", "--dtype", "--speculative"} <= shared
    assert "--collective-timeout" not in shared and "--port" not in shared
    assert shared <= _flags("generate")


def test_a_bad_value_gets_its_declared_line_on_the_line_and_from_python():
    args = command_parser("serve").parse_args(
        ["--checkpoint", "x", "--prefill-per-step", "-1", "--allowed-host", "a",
         "--allowed-host", "b", "--no-prefix-cache"])
    cfg = ServeConfig(**knob_values(args, ServeConfig))
    assert cfg.allowed_host == ("a", "b") and cfg.prefix_cache is False
    assert cfg.problems() == ["--prefill-per-step=-1 must be >= 0 (0: no limit)"]
    with pytest.raises(UserError, match=r"^prefill_per_step=-1 must be >= 0 \(0: no limit\)$"):
        refuse(prefill_per_step=-1)  # Engine's check: the same declaration, by its field
    assert ServeConfig(decode_chunk=2).problems() == [
        "--decode-chunk=2 needs --batch-invariant (without it a decode computes the "
        "running requests' rows)"]
    assert ServeConfig(batch_invariant=True).chunk == 8 and ServeConfig().chunk is None
    assert ServeConfig(speculative="ngram", speculative_tokens=9).problems() == [
        "--speculative-tokens=9 must be in [1, 7] (the proposed tokens and the last one are "
        "one forward of <= 8 rows)"]  # said once
    assert ServeConfig(speculative="draft").problems() == [
        "--speculative draft needs --draft-checkpoint PATH"]


NEW = Section("serving", "a section of a new knob")


@dataclass(frozen=True)
class WithMore(ServeConfig):
    """ServeConfig and two more knobs, one repeatable (as `--lora NAME=DIR` is)."""

    preload: tuple[str, ...] = NEW.knob((), "a prompt file read at start; repeatable",
                                        metavar="NAME=FILE")
    preload_limit: int = NEW.knob(8, "prompt files at most", check=AT_LEAST_1)


def test_a_new_knob_is_one_entry():
    parser = argparse.ArgumentParser()
    add_knobs(parser, WithMore)
    args = parser.parse_args(["--preload", "a=/x", "--preload", "b=/y",
                              "--preload-limit", "0", "--lora", "c=/z"])
    cfg = WithMore(**knob_values(args, WithMore))
    assert cfg.preload == ("a=/x", "b=/y") and cfg.lora == ("c=/z",)
    assert cfg.problems() == ["--preload-limit=0 must be >= 1"]
    assert "--preload NAME=FILE" in parser.format_help()
