"""The tensor-parallelism quiz as a live tutor, in French and English.

    tpkit quiz [--lang fr|en] [--shuffle] [--live] [--answers 1,3,2,...]
    tpkit quiz --web [--port P]

`content` loads and validates the questions (`questions.json`), `tutor` runs them in
the terminal, `web` serves them to a browser, and `live` proves each answer with a
real run of the library on local CPU processes (the only module that imports torch,
and only when `--live` asks for it).
"""

from tpkit.quiz.content import Item, Quiz, load_quiz

__all__ = ["Item", "Quiz", "load_quiz"]
