"""The words of the live demonstrations, per language, from `live_text.json`.

    say = Say("fr", "split")
    say("rank", rank=0, fc1=[32, 16], fc2=[16, 32])   # '  rang 0 : fc1 [32, 16] ...'
    say.records([("all_reduce", "forward", 128, 512)])  # 'all-reduce en passe avant de 128 valeurs'

The file holds, for each language, one section per demonstration (templates with
named fields, `str.format` style) and a `common` section (ledger record, names of
collectives and phases, yes/no). The demonstrations compute every figure and pass it
in; nothing here knows a number. `problems` checks that every language has the same
templates with the same fields. Pure Python, no torch.
"""

from __future__ import annotations

import functools
import json
import string
from importlib import resources
from typing import Any

from tpkit.quiz.content import typeset

Record = tuple  # (op, phase, numel, wire bytes), as the ranks return the ledger


@functools.cache
def templates() -> dict[str, Any]:
    """The parsed `live_text.json` (read once)."""
    raw = resources.files("tpkit.quiz").joinpath("live_text.json").read_text("utf-8")
    return json.loads(raw)


class Say:
    """The templates of one demonstration in one language: `say(key, **fields) -> str`."""

    def __init__(self, lang: str, demo: str) -> None:
        data = templates()
        if lang not in data:
            raise ValueError(f"no live text in language {lang!r}; have {sorted(data)}")
        self.lang, self.words, self.common = lang, data[lang][demo], data[lang]["common"]

    def __call__(self, key: str, **fields: Any) -> str:
        """Template `key` filled with the computed `fields` (French typography in fr)."""
        return typeset(self.words[key].format(**fields), self.lang)

    def yes_no(self, flag: bool) -> str:
        """'yes'/'no' in this language."""
        return self.common["yes" if flag else "no"]

    def records(self, records: list[Record]) -> str:
        """Ledger records as one line: 'all_reduce forward of 128 floats, ...'."""
        ops, phases = self.common["ops"], self.common["phases"]
        return ", ".join(self.common["record"].format(op=ops.get(op, op),
                                                      phase=phases.get(phase, phase), n=n)
                         for op, phase, n, *_ in records)


def fields(template: str) -> set[str]:
    """Named fields of a template: '{a:.1f} of {b}' -> {'a', 'b'}."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def problems(data: dict[str, Any]) -> list[str]:
    """Every template missing in a language or with other fields than in the first one."""
    langs = list(data)
    out: list[str] = []
    first = data[langs[0]]
    for lang in langs[1:]:
        for demo, words in first.items():
            other = data[lang].get(demo, {})
            for key, text in words.items():
                if key not in other:
                    out.append(f"{lang}: {demo}.{key} missing")
                elif isinstance(text, str) and fields(text) != fields(other[key]):
                    out.append(f"{lang}: {demo}.{key} has fields {sorted(fields(other[key]))}, "
                               f"{langs[0]} has {sorted(fields(text))}")
        out += [f"{lang}: {demo} is not in {langs[0]}" for demo in data[lang] if demo not in first]
    return out
