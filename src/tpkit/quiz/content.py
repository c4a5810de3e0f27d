"""The quiz's content: load `questions.json`, validate it, and lay it out for one sitting.

    quiz = load_quiz()                       # validated, or ValueError naming the problems
    items = quiz.items("fr", shuffle=True, seed=3)
    items[0].options, items[0].correct       # options as shown, index of the right one

The file holds 8 questions, each with 4 options in the seed's order, the index of the
correct option (the same in every language), an explanation, and a diagram key used by
the web page; plus the interface strings of each language. Pure Python, no torch.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

NUM_QUESTIONS = 8
NUM_OPTIONS = 4


@dataclass(frozen=True)
class Item:
    """One question as shown in one sitting: text, options in display order, right index."""

    number: int  # 1..8, position in the seed (the live demonstration's number)
    id: str
    question: str
    options: tuple[str, ...]
    correct: int  # index into `options` (display order)
    explanation: str
    diagram: str


@dataclass(frozen=True)
class Quiz:
    """The validated content of `questions.json`."""

    data: dict[str, Any]

    @property
    def languages(self) -> list[str]:
        """Language codes, e.g. ['fr', 'en']."""
        return list(self.data["languages"])

    def ui(self, lang: str) -> dict[str, str]:
        """Interface strings of one language."""
        return self.data["ui"][self._check_lang(lang)]

    def title(self, lang: str) -> str:
        """Title of the quiz in one language."""
        return self.data["title"][self._check_lang(lang)]

    def intro(self, lang: str) -> str:
        """One-line introduction in one language."""
        return self.data["intro"][self._check_lang(lang)]

    def items(self, lang: str, shuffle: bool = False, seed: int | None = None) -> list[Item]:
        """The questions in one language; `shuffle` permutes questions and options."""
        lang = self._check_lang(lang)
        rng = random.Random(seed)
        out = []
        for number, q in enumerate(self.data["questions"], start=1):
            text = q[lang]
            order = list(range(NUM_OPTIONS))
            if shuffle:
                rng.shuffle(order)
            out.append(Item(number=number, id=q["id"], question=text["question"],
                            options=tuple(text["options"][i] for i in order),
                            correct=order.index(q["answer"]), explanation=text["explanation"],
                            diagram=q.get("diagram", "")))
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
    if len(questions) != NUM_QUESTIONS:
        out.append(f"{len(questions)} questions, expected {NUM_QUESTIONS}")
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
