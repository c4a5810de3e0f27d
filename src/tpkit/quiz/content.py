"""The quiz's content: load `questions.json`, validate it, and lay it out for one sitting.

    quiz = load_quiz()                        # validated, or ValueError naming the problems
    items = quiz.items("fr", level=1, seed=3) # options shuffled (seeded), questions in order
    items[0].options, items[0].correct        # options as shown, index of the right one
    items[0].order                            # shown position -> the seed's option index

The file holds two levels of 8 questions. Level 1 is the seed quiz, its questions and
options word for word in the language the seed wrote them in; level 2 asks about what
tpkit implements. Each question has 4 options in the seed's order (`answer` is an
index into them, the same in every language), an explanation and a diagram key; plus
the interface strings of each language. The options are shown in a seeded random
order, so the right one is not always in the same place; `order` maps back to the
seed's numbering, which `--answers` uses. French text gets its non-breaking spaces
here (`typeset`). Pure Python, no torch.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

NUM_QUESTIONS = 8  # per level
NUM_OPTIONS = 4
LEVELS = (1, 2)
_SMALL_NUMBER = re.compile(r"[1-9][0-9]?")  # ASCII only: '²'.isdigit() is True in Python


def small_number(text: str, most: int) -> int | None:
    """The number 1..`most` (< 100) that `text` spells in ASCII digits, else None (also
    for a line of a million digits: never converted)."""
    return int(text) if _SMALL_NUMBER.fullmatch(text) and int(text) <= most else None
NBSP, NNBSP = "\u00a0", "\u202f"  # before ':' / before '?', '!', ';' (and inside « »)


def typeset(text: str, lang: str) -> str:
    """French typography: the space before ? ! ; : and inside « » cannot break."""
    if lang != "fr":
        return text
    text = re.sub(r" ([?!;])", NNBSP + r"\1", text)
    text = re.sub(r" :(?=\s|$)", NBSP + ":", text)
    return text.replace("« ", "«" + NBSP).replace(" »", NBSP + "»")


@dataclass(frozen=True)
class Item:
    """One question as shown in one sitting: text, options in display order, right index."""

    level: int
    number: int  # 1..8 within its level (the live demonstration's number)
    id: str
    question: str
    options: tuple[str, ...]
    correct: int  # index into `options` (display order)
    explanation: str
    diagram: str
    order: tuple[int, ...]  # order[k]: the seed's index of the option shown at position k

    def shown(self, seed_index: int) -> int:
        """Display position of the option that the seed numbers `seed_index` (0-based)."""
        return self.order.index(seed_index)


@dataclass(frozen=True)
class Quiz:
    """The validated content of `questions.json`."""

    data: dict[str, Any]

    @property
    def languages(self) -> list[str]:
        """Language codes, e.g. ['fr', 'en']."""
        return list(self.data["languages"])

    def ui(self, lang: str) -> dict[str, str]:
        """Interface strings of one language, typeset."""
        return {k: typeset(v, lang) for k, v in self.data["ui"][self._check_lang(lang)].items()}

    def title(self, lang: str) -> str:
        """Title of the quiz in one language."""
        return typeset(self.data["title"][self._check_lang(lang)], lang)

    def intro(self, lang: str) -> str:
        """One-line introduction in one language."""
        return typeset(self.data["intro"][self._check_lang(lang)], lang)

    def questions(self, level: int) -> list[dict[str, Any]]:
        """The raw questions of one level, in the file's order."""
        if level not in LEVELS:
            raise ValueError(f"level {level} does not exist; levels are {list(LEVELS)}")
        return [q for q in self.data["questions"] if q["level"] == level]

    def items(self, lang: str, level: int = 1, shuffle: bool = False,
              seed: int | None = None) -> list[Item]:
        """The questions of one level in one language, options in a seeded random order;
        `shuffle` also permutes the questions."""
        lang = self._check_lang(lang)
        rng = random.Random(seed)
        out = []
        for number, q in enumerate(self.questions(level), start=1):
            text, order = q[lang], list(range(NUM_OPTIONS))
            rng.shuffle(order)
            out.append(Item(level=level, number=number, id=q["id"],
                            question=typeset(text["question"], lang),
                            options=tuple(typeset(text["options"][i], lang) for i in order),
                            correct=order.index(q["answer"]),
                            explanation=typeset(text["explanation"], lang),
                            diagram=q.get("diagram", ""), order=tuple(order)))
        if shuffle:
            rng.shuffle(out)
        return out

    def _check_lang(self, lang: str) -> str:
        if lang not in self.data["languages"]:
            raise ValueError(f"language {lang!r} is not one of {self.data['languages']}")
        return lang


def problems(data: dict[str, Any]) -> list[str]:
    """Every reason `data` is not a valid quiz; empty when it is."""
    langs = data.get("languages")
    if not isinstance(langs, list) or not langs:
        return ["'languages' must be a non-empty list"]
    out: list[str] = []
    for key in ("title", "intro", "ui"):
        missing = [lang for lang in langs if lang not in data.get(key, {})]
        if missing:
            out.append(f"'{key}' has no text for {missing}")
    ui_keys = [set(data.get("ui", {}).get(lang, {})) for lang in langs]
    if ui_keys and any(k != ui_keys[0] for k in ui_keys):
        out.append("'ui' strings differ in keys between languages")
    questions = data.get("questions", [])
    for level in LEVELS:
        count = sum(q.get("level") == level for q in questions)
        if count != NUM_QUESTIONS:
            out.append(f"level {level} has {count} questions, expected {NUM_QUESTIONS}")
    ids = [q.get("id") for q in questions]
    if len(set(ids)) != len(ids):
        out.append(f"question ids are not unique: {ids}")
    for n, q in enumerate(questions, start=1):
        out += _question_problems(n, q, langs)
    return out


def _question_problems(n: int, q: dict[str, Any], langs: list[str]) -> list[str]:
    out = []
    answer = q.get("answer")
    if not isinstance(answer, int) or not 0 <= answer < NUM_OPTIONS:
        out.append(f"question {n}: answer={answer!r} is not an index in 0..{NUM_OPTIONS - 1}")
    for lang in langs:
        text = q.get(lang)
        if not isinstance(text, dict):
            out.append(f"question {n}: no '{lang}' text")
            continue
        options = text.get("options", [])
        if len(options) != NUM_OPTIONS or len(set(options)) != len(options):
            out.append(f"question {n} ({lang}): {len(options)} distinct options expected "
                       f"{NUM_OPTIONS}")
        for field in ("question", "explanation"):
            if not str(text.get(field, "")).strip():
                out.append(f"question {n} ({lang}): empty {field}")
    return out


def load_quiz(path: str | Path | None = None) -> Quiz:
    """Read and validate the quiz (the packaged `questions.json` by default)."""
    if path is None:
        raw = resources.files("tpkit.quiz").joinpath("questions.json").read_text("utf-8")
    else:
        raw = Path(path).read_text("utf-8")
    data = json.loads(raw)
    found = problems(data)
    if found:
        raise ValueError("invalid quiz content: " + "; ".join(found))
    return Quiz(data)
