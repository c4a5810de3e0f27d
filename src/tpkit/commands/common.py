"""What the options of every `tpkit` command share: the groups they are listed under,
a help formatter that shows each default (and choices as {a,b,c}), and the close-match
suggestion for a misspelt command, flag or choice.

    p = group(parser, "parallelism")          # the same heading from any module adds to it
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    # tpkit train --help:   --tp TP    tensor-parallel size (default: 1)

A renamed flag keeps its old spelling as a deprecated alias (`deprecated_alias`): parsed
as the new one, with one notice line on stderr, hidden from --help:

    tpkit train: warning: --nproc is deprecated, use --processes (under torchrun only
    --processes works)

A command's knobs (`tpkit.spec.knobs`: `TrainConfig`, `ServeConfig`) become its flags
with `add_knobs`, read back with `knob_values`.

Pure Python (argparse; the suggestion: `tpkit.spec.words.suggest`): `tpkit --help` and
`tpkit plan` import no torch.
"""

from __future__ import annotations

import argparse
import re
import sys

from tpkit.spec.knobs import Knob, knobs, sections
from tpkit.spec.words import suggest


def group(parser: argparse.ArgumentParser, title: str, about: str | None = None
          ) -> argparse._ArgumentGroup:
    """The argument group headed `title`, created on first use (with the line `about`
    under it): several modules may add flags under one heading. `tpkit train`'s are the
    sections of its config ([model], [parallelism], ...), which the other commands share."""
    for g in parser._action_groups:
        if g.title == title:
            return g
    return parser.add_argument_group(title, about)


class _Deprecated(argparse.Action):
    """The old spelling of a flag: stores what the new one stores, after one notice."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kw) -> None:
        super().__init__(option_strings, dest, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated, use {self.new} "
              f"(under torchrun only {self.new} works)", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def deprecated_alias(where: argparse.ArgumentParser | argparse._ArgumentGroup,
                     action: argparse.Action, old: str) -> None:
    """Accept `old`, a former spelling of `action`'s flag, as that flag (with a one-line
    deprecation notice; not in --help). Only where tpkit's own parser reads it: under
    torchrun, whose parser takes abbreviations of its options anywhere on the line,
    `tests/test_torchrun_flags` checks that torchrun refuses it rather than misreads it."""
    where.add_argument(old, action=_Deprecated, new=action.option_strings[0], dest=action.dest,
                       nargs=action.nargs, const=action.const, type=action.type,
                       choices=action.choices, metavar=action.metavar,
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_knobs(parser: argparse.ArgumentParser, cls: type, keep=None) -> None:
    """The flags of the knobs of `cls` (`tpkit.spec.knobs`; `keep(knob)`: those it says),
    in a group per section titled by its name, each help with its default. A flag not
    given is not in the namespace (SUPPRESS): the declaration's default (or a file's
    value) stands, as `knob_values` reads them."""
    for name, ks in sections(cls).items():
        ks = [k for k in ks if keep is None or keep(k)]
        if ks:
            where = group(parser, name, ks[0].section.about)
            for k in ks:
                _add_knob(where, k)


def _add_knob(where: argparse._ArgumentGroup, k: Knob) -> None:
    """The flag of knob `k` (default: SUPPRESS; repeatable for a tuple knob)."""
    flag, text, kw = k.option, k.help, dict(dest=k.name, default=argparse.SUPPRESS)
    if k.kind is bool:
        action = where.add_argument(flag, action="store_false" if k.default else "store_true",
                                    help=text, **kw)
        return _old_flags(where, action, k)
    if k.default is not None and not says_default(text):
        text += f" (default: {shown(k.default)})"
    if k.choices is not None:
        action = where.add_argument(flag, choices=k.choices, help=text, **kw)
    else:
        action = where.add_argument(flag, type=k.kind, help=text,
                                    action="append" if k.many else "store",
                                    metavar=k.metavar or ("N" if k.kind is int else "X"), **kw)
    _old_flags(where, action, k)


def _old_flags(where: argparse._ArgumentGroup, action: argparse.Action, k: Knob) -> None:
    for old in k.old_flags:
        deprecated_alias(where, action, old)


def knob_values(args: argparse.Namespace, cls: type) -> dict:
    """The knobs of `cls` given on the command line (`add_knobs`), as the dataclass takes
    them (a repeated flag's values as a tuple)."""
    given = vars(args)
    return {k.name: tuple(given[k.name]) if k.many else given[k.name]
            for k in knobs(cls) if k.name in given}


def shown(value) -> str:
    """A default as --help prints it: lists comma-joined, an empty one as 'none'."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "none"
    return str(value)


def says_default(text: str) -> bool:
    """Whether a help text already states its default ('default', 'required')."""
    return bool(re.search(r"\bdefault\b|%\(default\)", text, re.IGNORECASE))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with each option's default appended ("(default: 1)") unless the text already
    says it; flags (store_true) and required options need none. Choices show as {a,b,c}
    (argparse's metavar for `choices=`). The description keeps its line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (says_default(text) or action.required or action.nargs == 0
                or default is None or default is argparse.SUPPRESS):
            return text
        return f"{text} (default: {shown(default).replace('%', '%%')})"


def explain_parse_error(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's error `message`, with a suggestion for a misspelt flag or choice."""
    if message.startswith("unrecognized arguments:"):
        flags = [o for a in parser._actions for o in a.option_strings]
        for word in message.split(":", 1)[1].split():
            if word.startswith("-"):
                hint = suggest(word.split("=", 1)[0], flags)
                if hint:
                    return message + hint
        return message
    bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if bad:
        choices = re.findall(r"'([^']*)'", bad.group(2)) or bad.group(2).split(", ")
        return message + suggest(bad.group(1), choices)
    return message
