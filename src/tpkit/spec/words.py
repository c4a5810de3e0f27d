"""The words of the messages every layer prints, written once. Pure Python.

    plural(1, "prompt")                    '1 prompt'
    plural(8, "micro-batch")               '8 micro-batches'
    suggest("gpt2-tinyy", PRESETS, n=2)    '; did you mean gpt2-tiny or bert-tiny?'
    number_ranges([1, 2, 3, 4, 8])         '1-4, 8'
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def plural(n: int, thing: str, things: str | None = None, fmt: str = "") -> str:
    """'1 thing', 'N things' (`things`: an irregular plural; `fmt`: how N is written,
    e.g. ',' for 12,345)."""
    if n == 1:
        return f"{n:{fmt}} {thing}"
    if things is None:
        things = thing + ("es" if thing.endswith(("s", "x", "ch", "sh")) else "s")
    return f"{n:{fmt}} {things}"


def suggest(word: str, options: Iterable[str], n: int = 1) -> str:
    """'; did you mean X?' (or 'X or Y?', up to `n` names) for the closest of `options`
    (difflib), or ''."""
    close = difflib.get_close_matches(word, list(options), n=n, cutoff=0.6)
    if not close:
        return ""
    names = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
    return f"; did you mean {names}?"


def number_ranges(numbers: Iterable[int]) -> str:
    """Sorted integers written short: runs of 3 or more as 'a-b': '1-4, 6, 8'."""
    runs: list[list[int]] = []
    for k in sorted(set(numbers)):
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) >= 3 else ", ".join(map(str, r))
                     for r in runs)
