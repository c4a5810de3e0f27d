"""Speculative decoding's options, torch-free (`tpkit generate`/`serve`'s flags and the
engine's `serve.speculate` both check them here)."""

from __future__ import annotations

from pathlib import Path

from tpkit.spec.errors import UserError

METHODS = ("ngram", "draft")  # --speculative's choices
TOKENS = 4  # --speculative-tokens' default (docs/benchmarks.md: measured)
MAX_TOKENS = 7  # a sequence's k + 1 rows fit one native call (decode_ops.ROWS = 8)


def check(method: str | None, tokens: int, draft: str | None = None) -> None:
    """UserError for a speculative method, token count or draft checkpoint (`draft`:
    --draft-checkpoint, for the method "draft" only) the engine cannot run."""
    check_draft(method, draft)
    if not 1 <= tokens <= MAX_TOKENS:
        raise UserError(f"--speculative-tokens={tokens} must be in [1, {MAX_TOKENS}] (the "
                        f"proposed tokens and the last one are one forward of <= 8 rows)")


def check_draft(method: str | None, draft: str | None) -> None:
    """UserError for a method other than METHODS, or a draft checkpoint without the
    method "draft" (or that method without one, or one that does not exist)."""
    if method is not None and method not in METHODS:
        raise UserError(f"--speculative={method!r}: the methods are {', '.join(METHODS)}")
    if (method == "draft") != (draft is not None):
        raise UserError("--speculative draft needs --draft-checkpoint PATH" if draft is None
                        else f"--draft-checkpoint={draft} needs --speculative draft")
    if draft is not None and not Path(draft).exists():
        raise UserError(f"--draft-checkpoint={draft}: no such file or folder")
