"""`tpkit quiz`: the tensor-parallelism quiz in the terminal or the browser.

    tpkit quiz --lang fr                      # interactive, in French
    tpkit quiz --answers 1,2,3,4,1,2,3,4      # scripted; ends with `Score: 8/8`
    printf '1\\n2\\n...' | tpkit quiz         # answers on stdin (not a TTY)
    tpkit quiz --live --tp 2                  # each explanation proved by a real run
    tpkit quiz --web --port 8765              # http://127.0.0.1:8765/

Without `--live` nothing here imports torch, so the quiz starts at once.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from tpkit.quiz.content import load_quiz
from tpkit.quiz.tutor import (
    AnswerError,
    from_lines,
    interactive,
    parse_answers,
    run_tutor,
    scripted,
)
from tpkit.spec.errors import UserError


def _default_lang() -> str:
    return "fr" if os.environ.get("LANG", "").lower().startswith("fr") else "en"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit quiz`."""
    parser.add_argument("--lang", choices=("fr", "en"), default=_default_lang(),
                        help="language of the quiz (default: from $LANG, else en)")
    parser.add_argument("--shuffle", action="store_true",
                        help="shuffle the questions and their options")
    parser.add_argument("--seed", type=int, default=None, help="seed of --shuffle")
    parser.add_argument("--live", action="store_true",
                        help="prove each answer with a real run of the library on CPU processes")
    parser.add_argument("--tp", type=int, default=2, choices=(2, 4),
                        help="tensor-parallel size of the live demonstrations (default 2)")
    parser.add_argument("--answers", default=None,
                        help="comma-separated answers 1..4, one per question (non-interactive)")
    parser.add_argument("--web", action="store_true", help="serve the quiz to a browser")
    parser.add_argument("--port", type=int, default=8765, help="port of --web (127.0.0.1 only)")


def run(args: argparse.Namespace) -> int:
    """Run the quiz; 0 on success, 2 on a bad scripted answer."""
    quiz = load_quiz()
    if args.web:
        from tpkit.quiz.web import serve

        try:
            return serve(quiz, port=args.port, lang=args.lang, live=args.live)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise UserError(f"port {args.port} is already in use on 127.0.0.1; choose "
                            f"another with --port") from None
    items = quiz.items(args.lang, shuffle=args.shuffle, seed=args.seed)
    try:
        if args.answers is not None:
            answer, echo = scripted(parse_answers(args.answers, len(items))), True
        elif sys.stdin.isatty():
            answer, echo = interactive(input, sys.stdout), False
        else:
            answer, echo = from_lines(sys.stdin), True
        if args.live:
            from tpkit.quiz.live import LiveSession

            with LiveSession() as session:
                run_tutor(items, quiz.ui(args.lang), answer, sys.stdout, echo=echo,
                          live=lambda n: session.text(n, tp=args.tp, lang=args.lang))
        else:
            run_tutor(items, quiz.ui(args.lang), answer, sys.stdout, echo=echo)
    except AnswerError as e:
        print(f"tpkit quiz: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, EOFError):
        print(file=sys.stderr)
        return 130
    return 0
