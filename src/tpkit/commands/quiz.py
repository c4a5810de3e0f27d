"""`tpkit quiz`: the tensor-parallelism quiz in the terminal or the browser.

    tpkit quiz --lang fr                      # interactive, in French
    tpkit quiz --level 2                      # 8 questions on what tpkit implements
    tpkit quiz --answers 4,1,2,2,3,1,4,3      # scripted; ends with exactly `Score: N/8`
    printf '1\\n2\\n...' | tpkit quiz         # answers on stdin (not a TTY), as shown
    tpkit quiz --live --tp 2                  # each explanation proved by a real run
    tpkit quiz --web --port 8765              # http://127.0.0.1:8765/

The options are shown in a random order (seeded: `--seed N` repeats a sitting). Answers
typed or piped are numbered as shown; `--answers` numbers the options as the seed quiz
lists them (the order of `questions.json`), so a script means the same every run.
Without `--live` nothing here imports torch, so the quiz starts at once.
"""

from __future__ import annotations

import argparse
import os
import sys

from tpkit.host.exit import exit_now
from tpkit.host.web import ALLOWED_HOST_HELP
from tpkit.quiz.content import load_quiz
from tpkit.quiz.live import LiveSession
from tpkit.quiz.tutor import (
    AnswerError,
    from_lines,
    interactive,
    parse_answers,
    run_tutor,
    scripted,
)
from tpkit.quiz.web import serve
from tpkit.spec.transport import add_comm_argument, comm_choice


def _default_lang() -> str:
    return "fr" if os.environ.get("LANG", "").lower().startswith("fr") else "en"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit quiz`."""
    parser.add_argument("--lang", choices=("fr", "en"), default=_default_lang(),
                        help="language of the quiz (default: from $LANG, else en)")
    parser.add_argument("--level", type=int, choices=(1, 2), default=1,
                        help="1: the seed quiz (default); 2: what tpkit implements")
    parser.add_argument("--shuffle", action="store_true",
                        help="also shuffle the order of the questions")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the option order (and of --shuffle); default: random")
    parser.add_argument("--live", action="store_true",
                        help="prove each answer with a real run of the library on CPU processes")
    parser.add_argument("--no-hosts", dest="hosts", action="store_false",
                        help="with --live: questions 3 and 8 on this host only (by default, "
                             "run as root, also across two simulated hosts at 10 and 1 "
                             "Gbit/s: `tpkit cluster`, about 25 s once per sitting)")
    parser.add_argument("--tp", type=int, default=2, choices=(2, 4),
                        help="tensor-parallel size of the live demonstrations (default 2)")
    parser.add_argument("--answers", default=None,
                        help="comma-separated answers 1..4, one per question, numbered as in "
                             "the seed quiz whatever the order shown (non-interactive; the "
                             "last line is then exactly 'Score: N/8') (default: asked one "
                             "by one)")
    add_comm_argument(parser)
    parser.add_argument("--web", action="store_true", help="serve the quiz to a browser")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address of --web (default 127.0.0.1; others warn: no login)")
    parser.add_argument("--port", type=int, default=8765,
                        help="port of --web (default 8765; 0: any free port)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help=f"of --web: {ALLOWED_HOST_HELP}")


def run(args: argparse.Namespace) -> int:
    """Run the quiz; 0 on success, 2 on a bad scripted answer."""
    quiz = load_quiz()
    if args.web:
        # serve returns once a signal stopped it and its workers are gone: end at once
        exit_now(serve(quiz, host=args.host, port=args.port, lang=args.lang, live=args.live,
                       comm=comm_choice(getattr(args, "comm", None)),
                       allowed_hosts=args.allowed_host, hosts=None if args.hosts else False))
    items = quiz.items(args.lang, level=args.level, shuffle=args.shuffle, seed=args.seed)
    try:
        if args.answers is not None:
            answer, echo = scripted(parse_answers(args.answers, len(items))), True
        elif sys.stdin.isatty():
            answer, echo = interactive(input, sys.stdout), False
        else:
            answer, echo = from_lines(sys.stdin), True
        if args.live:
            with LiveSession(comm=comm_choice(getattr(args, "comm", None)),
                             hosts=None if args.hosts else False) as session:
                run_tutor(items, quiz.ui(args.lang), answer, sys.stdout, echo=echo,
                          exact_score=args.answers is not None,
                          live=lambda n: session.text(n, tp=args.tp, lang=args.lang,
                                                      level=args.level))
        else:
            run_tutor(items, quiz.ui(args.lang), answer, sys.stdout, echo=echo,
                      exact_score=args.answers is not None)
    except AnswerError as e:
        print(f"tpkit quiz: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the CLI's one line "stopped by SIGINT", exit 130
        if sys.stdin.isatty():
            print(file=sys.stderr)  # after the terminal's ^C, on a line of its own
        raise
    except EOFError:
        print(file=sys.stderr)
        return 130
    return 0
