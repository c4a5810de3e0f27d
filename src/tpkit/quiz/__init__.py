"""The tensor-parallelism quiz as a live tutor, in French and English.

    tpkit quiz [--lang fr|en] [--level 1|2] [--seed N] [--live] [--answers 1,3,2,...]
    tpkit quiz --web [--host H] [--port P] [--live]

`content` loads and validates the questions (`questions.json`: level 1 is the seed
quiz, level 2 what tpkit implements), `tutor` runs them in the terminal, `web` and
`web_api` serve them to a browser (`web/`: the page, its charts and diagrams), and
`live` proves each answer with a real run of the library on local CPU processes
(`live_level1`, `live_level2`, `live_ranks`; charts from `live_charts`, words from
`live_text`; answers 3 and 8 also across simulated hosts, as root, `live_hosts`) — the
only modules that import torch, and only when `--live` asks.
"""

from tpkit.quiz.content import Item, Quiz, load_quiz

__all__ = ["Item", "Quiz", "load_quiz"]
