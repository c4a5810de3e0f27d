"""What the options of every `tpkit` command share: the groups they are listed under,
a help formatter that shows each default (and choices as {a,b,c}), and the close-match
suggestion for a misspelt command, flag or choice.

    p = group(parser, "parallelism")          # the same heading from any module adds to it
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    # tpkit train --help:   --tp TP    tensor-parallel size (default: 1)

Pure Python (argparse; the suggestion: `tpkit.spec.words.suggest`): `tpkit --help` and
`tpkit plan` import no torch.
"""

from __future__ import annotations

import argparse
import re

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


def add_pool_arguments(g: argparse._ArgumentGroup, max_batch: int | None, batch_help: str
                       ) -> None:
    """The serving engine's KV pool, as `tpkit generate` and `tpkit serve` both take it:
    --max-batch (default and help per command), --max-len, --decode-chunk."""
    g.add_argument("--max-batch", type=int, default=max_batch, metavar="B", help=batch_help)
    g.add_argument("--max-len", type=int, default=None, metavar="L",
                   help="tokens per sequence, prompt included (default: the model's "
                        "max_seq_len)")
    g.add_argument("--decode-chunk", type=int, default=8, metavar="C",
                   help="slots decoded together in one forward: 8 serves many clients best, 1 "
                        "decodes each sequence alone (fastest with one or two at a time); "
                        "whichever, a request's tokens never depend on what else runs")


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
