"""The "sample it:" line at the end of a run (what `make demo` ends with): on the embedded
corpus its prompt is a line of that corpus and, while the loss is high, a second line says
what such a model writes (word-like pieces that repeat themselves); on the user's data
the prompt is theirs to give, and no word about a corpus tpkit did not choose."""

from __future__ import annotations

import shlex

from tpkit.train.config import TrainConfig
from tpkit.train.data import embedded_text
from tpkit.train.report import RunSummary, sample_hint


def _summary(tail_loss: float, **config) -> RunSummary:
    cfg = TrainConfig().with_(steps=400, tp=2, **config)
    return RunSummary(config=cfg, rank=0, stage=0, tp_rank=0, hidden=64, micro_batch=4,
                      losses=[5.4, tail_loss], grad_norms=[1.0, 1.0], first_step=1, tail=1,
                      tail_loss=tail_loss, val_loss=None, tokens_per_s=1.0, seconds=1.0,
                      bubble=0.0, bubble_theory=0.0, max_inflight=1, table="", theory="",
                      theory_ok=True, checkpoint="runs/demo/checkpoints/step_000400",
                      metrics="runs/demo/metrics.jsonl", plot=None)


def _prompt(line: str) -> str:
    argv = shlex.split(line.removeprefix("sample it:"))
    assert argv[:2] == ["tpkit", "generate"] and argv[argv.index("--tp") + 1] == "2", argv
    return argv[argv.index("--prompt") + 1]


def test_the_demos_hint_uses_its_corpus_and_says_what_to_expect():
    first, note = sample_hint(_summary(2.42))
    assert _prompt(first) in embedded_text()
    assert "400 steps" in note and "2.42" in note and "repeats itself" in note, note
    assert f"{len(embedded_text()) // 1000} KB" in note


def test_a_learnt_corpus_or_the_users_data_get_no_warning():
    assert len(sample_hint(_summary(0.9))) == 1  # it has learnt something: no warning
    lines = sample_hint(_summary(2.42, data="notes.txt"))
    assert len(lines) == 1 and _prompt(lines[0]) not in embedded_text()
