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


NEW = Section("serving", "a section of a new knob")


@dataclass(frozen=True)
class WithLora(ServeConfig):
    """ServeConfig and one more knob, a repeatable one, as `--lora NAME=DIR` would be."""

    lora: tuple[str, ...] = NEW.knob((), "an adapter requests may name; repeatable",
                                     metavar="NAME=DIR")
    lora_rank: int = NEW.knob(8, "largest adapter rank", check=AT_LEAST_1)


def test_a_new_knob_is_one_entry():
    parser = argparse.ArgumentParser()
    add_knobs(parser, WithLora)
    args = parser.parse_args(["--lora", "a=/x", "--lora", "b=/y", "--lora-rank", "0"])
    cfg = WithLora(**knob_values(args, WithLora))
    assert cfg.lora == ("a=/x", "b=/y")
    assert cfg.problems() == ["--lora-rank=0 must be >= 1"]
    assert "--lora NAME=DIR" in parser.format_help()
