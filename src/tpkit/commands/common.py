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

Pure Python (argparse; the suggestion: `tpkit.spec.words.suggest`): `tpkit --help` and
`tpkit plan` import no torch.
"""

from __future__ import annotations

import argparse
import re
import sys

from tpkit.spec import speculative as speculate
from tpkit.spec.config import QUANTIZE
from tpkit.spec.errors import UserError
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


DTYPES = ("float32", "bfloat16", "float16")  # --dtype of generate and serve
INVARIANT_CHUNK = 8  # --decode-chunk's default under --batch-invariant


def add_pool_arguments(g: argparse._ArgumentGroup, max_batch: int | None, batch_help: str
                       ) -> None:
    """The serving engine's KV cache and decode, as `tpkit generate` and `tpkit serve` both
    take them: --dtype, --quantize, --max-batch (default and help per command), --max-len,
    --batch-invariant and its --decode-chunk (`decode_chunk` reads the pair)."""
    g.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights, activations and KV cache in this dtype (bfloat16, "
                        "float16: half the memory); the logits' softmax and the sampling "
                        "run in float32 whatever it is")
    g.add_argument("--quantize", choices=QUANTIZE, default=None,
                   help="int8: every linear weight and the head as int8 with a scale per "
                        "row, a quarter of float32's bytes per token (bfloat16 activations "
                        "in the product; its quality cost: docs/benchmarks.md); default: "
                        "none, the weights as --dtype says")
    g.add_argument("--max-batch", type=int, default=max_batch, metavar="B", help=batch_help)
    g.add_argument("--max-len", type=int, default=None, metavar="L",
                   help="tokens per sequence, prompt included (default: the model's "
                        "max_seq_len)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="decode in forwards of --decode-chunk rows (padded) and prompts in "
                        "pieces cut at multiples of 64 tokens, so a "
                        "request's tokens are bit for bit the same whatever else runs; "
                        "without it each decode computes the running requests' rows only "
                        "(fastest at any load; a token may then change with the batch where "
                        "two logits are within rounding)")
    g.add_argument("--decode-chunk", type=int, default=None, metavar="C",
                   help=f"with --batch-invariant: rows per decode forward (default: "
                        f"{INVARIANT_CHUNK}; 8 serves many clients best, 1 decodes each "
                        f"sequence alone)")
    g.add_argument("--speculative", choices=speculate.METHODS, default=None,
                   help="ngram: propose the tokens that followed the latest earlier match "
                        "of the last few tokens (prompt lookup); draft: a smaller model's "
                        "(--draft-checkpoint); either verified in one forward, the output "
                        "unchanged (docs/serving.md); default: none")
    g.add_argument("--speculative-tokens", type=int, default=speculate.TOKENS, metavar="K",
                   help=f"with --speculative: tokens proposed at most per sequence and step "
                        f"(1..{speculate.MAX_TOKENS}, default {speculate.TOKENS})")
    g.add_argument("--draft-checkpoint", default=None, metavar="PATH",
                   help="with --speculative draft: the draft model (any checkpoint tpkit "
                        "loads, with the model's tokenizer), run at tp=1 on rank 0")


def check_speculative(args: argparse.Namespace) -> None:
    """UserError for --speculative-tokens out of bounds or without --speculative."""
    if args.speculative is None and args.speculative_tokens != speculate.TOKENS:
        raise UserError(f"--speculative-tokens={args.speculative_tokens} needs "
                        f"--speculative ngram or draft")
    speculate.check(args.speculative, args.speculative_tokens, args.draft_checkpoint)


def speculator(args: argparse.Namespace, model=None, tokenizer=None):
    """The engine's `serve.speculate.Speculator` from --speculative,
    --speculative-tokens and --draft-checkpoint (its model loaded at tp=1, --dtype,
    checked against the target `model` and its `tokenizer`), or None
    (`check_speculative`'s errors)."""
    check_speculative(args)
    if args.speculative is None:
        return None
    from tpkit.serve.speculate import Speculator  # torch: only where it runs

    if args.speculative == "ngram":
        return Speculator(args.speculative_tokens)
    from tpkit.serve.draft import draft_speculator

    return draft_speculator(args.draft_checkpoint, model, tokenizer, args.speculative_tokens,
                            args.max_batch, args.max_len, args.dtype)


def decode_chunk(args: argparse.Namespace) -> int | None:
    """The engine's `decode_chunk` from --batch-invariant and --decode-chunk: None (the
    running rows) without --batch-invariant; UserError for --decode-chunk without it or
    below 1."""
    if not args.batch_invariant:
        if args.decode_chunk is not None:
            raise UserError(f"--decode-chunk={args.decode_chunk} needs --batch-invariant "
                            f"(without it a decode computes the running requests' rows)")
        return None
    chunk = INVARIANT_CHUNK if args.decode_chunk is None else args.decode_chunk
    if chunk < 1:
        raise UserError(f"--decode-chunk={chunk} must be >= 1")
    return chunk


def follower(args: argparse.Namespace, source) -> tuple:
    """`launch(follow=)` for `tpkit generate` and `tpkit serve`: every follower rank loads
    `source` as rank 0 does (--dtype, --quantize) and runs its steps (`serve.workers`)."""
    import torch  # lazy: this module stays pure Python (`tpkit --help`, `tpkit plan`)

    from tpkit.serve.workers import follow

    return (follow, (source, args.max_batch, args.max_len, decode_chunk(args),
                     getattr(torch, args.dtype), args.quantize))


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
