"""The terminal tutor: one question at a time, the verdict and explanation right after.

    score = run_tutor(items, ui, scripted([1, 2, 3, 4, 1, 2, 3, 4]), out=sys.stdout)

Answers come from one of three sources: `interactive` (asks again on a bad answer) and
`from_lines` (one per line, for piped stdin), both numbered 1..4 as the options are
shown; and `scripted` (from `--answers 1,3,2,...`), numbered as in the seed quiz, whatever
order the questions and options are shown in, so a script's answers mean the same thing
every run.
The last two raise `AnswerError` on a bad or missing answer, which the CLI turns into
exit code 2. At the end, a review of the missed questions (the right answer and its
explanation) and the score once, in the sitting's language ("Score : 6/8"), or exactly
`Score: N/8` with `exact_score` (for scripts). Pure Python, no torch (live text comes
from a callback, which the CLI binds to the sitting's language: `session.text(...)`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from typing import TextIO

from tpkit.quiz.content import NUM_OPTIONS, Item, small_number
from tpkit.spec.words import plural

AnswerFn = Callable[[Item, dict], int]  # returns the chosen option's index (0-based)
LiveFn = Callable[[int], str]  # question number (seed order) -> text, in the sitting's language
WIDTH = 88


class AnswerError(ValueError):
    """A scripted answer is missing or not a number between 1 and 4."""


def parse_answer(text: str, n: int = NUM_OPTIONS) -> int:
    """'3' -> 2 (0-based); AnswerError naming the text unless it is an integer in 1..n."""
    text = text.strip()
    number = small_number(text, n)
    if number is None:
        shown = repr(text) if len(text) <= 20 else f"{text[:12]!r}... ({len(text):,} characters)"
        raise AnswerError(f"answer {shown} is not a number between 1 and {n}")
    return number - 1


def parse_answers(text: str, count: int, n: int = NUM_OPTIONS) -> list[int]:
    """'1,3,2,...' -> 0-based indices; AnswerError unless there are exactly `count` valid ones."""
    parts = [p for p in text.replace(" ", ",").split(",") if p.strip()]
    if len(parts) != count:
        raise AnswerError(f"--answers has {plural(len(parts), 'answer')}, expected {count} "
                          f"(one option number 1..{n} per question, comma-separated)")
    out = []
    for i, part in enumerate(parts, start=1):
        try:
            out.append(parse_answer(part, n))
        except AnswerError as e:
            raise AnswerError(f"--answers, question {i}: {e}") from None
    return out


def scripted(answers: Sequence[int]) -> AnswerFn:
    """Answer from a list of 0-based indices (validated) numbered as in the seed quiz:
    `answers[n - 1]` answers question n, whatever order the questions are asked in
    (`--shuffle`), and names an option in the seed's order, whatever order it is shown in."""

    def answer(item: Item, ui: dict) -> int:
        if not 1 <= item.number <= len(answers):
            raise AnswerError(f"no answer given for question {item.number}")
        return item.shown(answers[item.number - 1])

    return answer


def from_lines(stream: TextIO) -> AnswerFn:
    """Answer from a stream, one answer per line (blank lines skipped)."""

    def answer(item: Item, ui: dict) -> int:
        for line in stream:
            if line.strip():
                return parse_answer(line, len(item.options))
        raise AnswerError(f"input ended before question {item.number} was answered")

    return answer


def interactive(read: Callable[[str], str], out: TextIO) -> AnswerFn:
    """Ask with `read(prompt)` (e.g. `input`) until the answer is valid."""

    def answer(item: Item, ui: dict) -> int:
        n = len(item.options)
        while True:
            try:
                return parse_answer(read(ui["prompt"].format(n=n)), n)
            except AnswerError:
                print(ui["invalid"].format(n=n), file=out)

    return answer


def render_question(item: Item, index: int, total: int, ui: dict) -> str:
    """The question and its numbered options."""
    lines = [f"{ui['question']} {index}/{total}", _wrap(item.question, "")]
    lines += [_wrap(opt, f"  {k}. ", "     ") for k, opt in enumerate(item.options, start=1)]
    return "\n".join(lines)


def render_verdict(item: Item, choice: int, ui: dict) -> str:
    """Right or wrong, the correct option, and the explanation."""
    ok = choice == item.correct
    head = ui["right"] if ok else ui["wrong"]
    right = f"{ui['correct_answer']} {item.correct + 1}. {item.options[item.correct]}"
    expl = _wrap(item.explanation, f"{ui['explanation']} ", "  ")
    return "\n".join([_wrap(f"{head} {right}", ""), expl])


def render_review(missed: list[tuple[Item, int]], ui: dict) -> str:
    """The missed questions, each with the answer given, the right one and why."""
    if not missed:
        return ui["review_none"]
    lines = [f"=== {ui['review']} ==="]
    for item, choice in missed:
        lines += [_wrap(f"{item.number}. {item.question}", ""),
                  _wrap(f"{ui['your_answer']} {item.options[choice]}", "   ", "     "),
                  _wrap(f"{ui['correct_answer']} {item.options[item.correct]}", "   ", "     "),
                  _wrap(item.explanation, "   "), ""]
    return "\n".join(lines).rstrip()


def run_tutor(items: list[Item], ui: dict, answer: AnswerFn, out: TextIO,
              live: LiveFn | None = None, echo: bool = False, exact_score: bool = False) -> int:
    """Ask every item in turn, explain after each answer, review the missed ones and
    print the score once (exactly `Score: N/8` with `exact_score`); return N."""
    missed: list[tuple[Item, int]] = []
    for index, item in enumerate(items, start=1):
        print(render_question(item, index, len(items), ui), file=out)
        choice = answer(item, ui)
        if echo:
            print(f"> {choice + 1}", file=out)
        if choice != item.correct:
            missed.append((item, choice))
        print(render_verdict(item, choice, ui), file=out)
        if live is not None:
            print(f"--- {ui['live']} ---", file=out)
            print(live(item.number), file=out)
        print(file=out, flush=True)
    print(render_review(missed, ui), file=out)
    score, total = len(items) - len(missed), len(items)
    line = f"Score: {score}/{total}" if exact_score else ui["score_line"].format(score=score,
                                                                                 total=total)
    print(line, file=out, flush=True)
    return score


def _wrap(text: str, first: str, rest: str | None = None) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=first,
                         subsequent_indent=first if rest is None else rest,
                         break_on_hyphens=False)
