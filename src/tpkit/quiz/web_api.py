"""What the web tutor's endpoints answer, as pure functions of the request (no HTTP here).

    quiz_payload(quiz, "fr", live=True)          # GET /api/quiz: questions, no answers
    check_answer(quiz, {"level": 1, "number": 2, "choice": 1})   # POST /api/answer
    live_request("/api/live/3", {"tp": ["4"]}, ...)              # GET /api/live/<n>

The page gets the questions and options (in the seed's order; it shows them shuffled)
but neither the answers nor the explanations: those come back one question at a time,
after the learner has chosen (`check_answer`). Every refusal is an (HTTP status,
{"error": message}) pair that names the problem. Pure Python, no torch.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from tpkit.quiz.content import LEVELS, NUM_OPTIONS, NUM_QUESTIONS, Quiz, small_number, typeset

LIVE_TP = (2, 4)
MAX_BODY = 4096  # bytes of a POST body; an answer is ~50
Reply = tuple[HTTPStatus, dict]


def quiz_payload(quiz: Quiz, lang: str, live: bool) -> dict:
    """What `/api/quiz` returns: texts of both levels, typeset, without answers."""
    langs = quiz.languages
    levels = {str(level): [_public_question(q, n, langs)
                           for n, q in enumerate(quiz.questions(level), start=1)]
              for level in LEVELS}
    return dict(languages=langs, default_lang=lang, live=live, live_tp=list(LIVE_TP),
                title={x: quiz.title(x) for x in langs}, intro={x: quiz.intro(x) for x in langs},
                ui={x: quiz.ui(x) for x in langs}, levels=levels)


def _public_question(q: dict, number: int, langs: list[str]) -> dict:
    out = dict(number=number, id=q["id"], diagram=q.get("diagram", ""))
    for lang in langs:
        out[lang] = dict(question=typeset(q[lang]["question"], lang),
                         options=[typeset(o, lang) for o in q[lang]["options"]])
    return out


def parse_body(raw: bytes) -> dict | Reply:
    """The JSON object of a POST body, or a 400 naming what is wrong with it."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return HTTPStatus.BAD_REQUEST, {"error": f"the body is not JSON: {e}"}
    except RecursionError:  # [[[[...: deeper than the parser goes (an answer has depth 1)
        return HTTPStatus.BAD_REQUEST, {"error": "the body is nested too deeply"}
    if not isinstance(body, dict):
        return HTTPStatus.BAD_REQUEST, {"error": "the body must be a JSON object"}
    return body


def check_answer(quiz: Quiz, body: dict[str, Any]) -> Reply:
    """Verdict of one answer: right or not, the seed's right index, explanations."""
    level, number, choice = (body.get(k) for k in ("level", "number", "choice"))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (level, number, choice)):
        return HTTPStatus.BAD_REQUEST, {"error": "level, number and choice must be integers"}
    if level not in LEVELS:
        return HTTPStatus.NOT_FOUND, {"error": f"no level {level}; levels are {list(LEVELS)}"}
    if not 1 <= number <= NUM_QUESTIONS:
        return HTTPStatus.NOT_FOUND, {"error": f"no question {number}; they are numbered "
                                               f"1 to {NUM_QUESTIONS}"}
    if not 0 <= choice < NUM_OPTIONS:
        return HTTPStatus.BAD_REQUEST, {"error": f"choice={choice} is not an option index "
                                                 f"0..{NUM_OPTIONS - 1}"}
    q = quiz.questions(level)[number - 1]
    return HTTPStatus.OK, dict(right=choice == q["answer"], answer=q["answer"],
                               explanation={x: typeset(q[x]["explanation"], x)
                                            for x in quiz.languages})


def live_request(path: str, query: dict[str, list[str]], default_lang: str,
                 languages: list[str]) -> tuple[int, int, int, str] | Reply:
    """(level, number, tp, lang) of `/api/live/<n>?tp=&lang=&level=`, or a refusal."""
    number = path.removeprefix("/api/live/")
    tp, level = (query.get("tp") or ["2"])[0], (query.get("level") or ["1"])[0]
    lang = (query.get("lang") or [default_lang])[0]
    if small_number(number, NUM_QUESTIONS) is None:
        return HTTPStatus.NOT_FOUND, {"error": f"demonstrations are numbered 1 to "
                                               f"{NUM_QUESTIONS}"}
    if level not in [str(x) for x in LEVELS]:
        return HTTPStatus.NOT_FOUND, {"error": f"level must be one of {list(LEVELS)}"}
    if tp not in [str(x) for x in LIVE_TP]:
        return HTTPStatus.BAD_REQUEST, {"error": f"tp must be one of {list(LIVE_TP)}"}
    if lang not in languages:
        return HTTPStatus.BAD_REQUEST, {"error": f"lang must be one of {languages}"}
    return int(level), int(number), int(tp), lang
