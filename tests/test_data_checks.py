"""Data checked before the first step, each case through the real `tpkit train` (or
`prepare-data`) where the user meets it: one line, exit 2, nothing trained.

- ids above the model's vocabulary (data of another tokenizer) at tp=2, where the
  vocab-parallel embedding would embed them as silent zeros; an index.json whose max_id
  lies (the shards are scanned); a tokenizer with another vocabulary size; a broken
  index.json (not JSON, missing keys) listing every problem;
- a corpus too short for a validation window says how many tokens each side got; a
  small corpus (20 blocks would be 160k tokens) trains with the default --val-fraction,
  and a tokenizer named differently with the same vocabulary size is a warning;
- prepare-data refuses a binary; the embedding itself refuses out-of-range ids on
  every tp rank, before its all-reduce.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tpkit.train.data import split_tokens
from tpkit.train.tokens import ShardWriter

TINY = ["--steps", "2", "--seq", "32", "--global-batch", "4", "--no-progress"]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`tpkit ARGV` through `tpkit.cli.main` in this process (the same parser and error
    path as the console script, without starting an interpreter): (status, out, err)."""
    from tpkit.cli import main

    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _shards(folder: Path, ids, vocab: int = 256, tokenizer: str = "bytes", **lie) -> str:
    w = ShardWriter(folder, vocab, meta=dict(tokenizer=tokenizer))
    w.write(np.asarray(ids))
    index = w.close()
    if lie:
        (folder / "index.json").write_text(json.dumps({**index, **lie}))
    return str(folder)


@pytest.mark.timeout(300)
def test_bad_data_is_one_line_before_the_first_step(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TPKIT_DEBUG", raising=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, 4000)
    other = _shards(tmp_path / "other", np.r_[ids, 299], vocab=300)
    lying = _shards(tmp_path / "lying", np.r_[ids, 299], vocab=300, max_id=200)
    vocab = _shards(tmp_path / "vocab", ids, vocab=300, tokenizer=str(tmp_path / "tok300"))
    broken = _shards(tmp_path / "broken", ids)
    (tmp_path / "broken" / "index.json").write_text('{"format": "tpkit-tokens", ')
    keys = _shards(tmp_path / "keys", ids, shards="shard_00000.bin", max_id="12")
    (tmp_path / "short.txt").write_text("x" * 100)
    elf = sys.executable  # a binary
    train = ["train", *TINY, "--out"]
    cases = [
        (train + [str(tmp_path / "o1"), "--tp", "2", "--data", other],
         "token id 299 in the data"),
        (train + [str(tmp_path / "o2"), "--data", lying],
         "shard_00000.bin holds token id 299, but index.json says max_id=200"),
        (train + [str(tmp_path / "o3"), "--data", vocab],
         f"was tokenized with {tmp_path / 'tok300'} (vocab_size=300), the model uses bytes"),
        (train + [str(tmp_path / "o4"), "--data", broken], "index.json: not valid JSON"),
        (train + [str(tmp_path / "o5"), "--data", keys],
         "index.json: max_id '12' is not an integer >= -1; shards 'shard_00000.bin' is not "
         "a list"),
        (train + [str(tmp_path / "o6"), "--data", str(tmp_path / "short.txt")],
         "training data has 67 tokens = 2 windows of seq=32, fewer than global_batch=4 (of "
         "100 tokens, 67 for training and 33 held out by --val-fraction 0.05)"),
        (["prepare-data", elf, "--tokenizer", "bytes", "--out", str(tmp_path / "p")],
         "not a text file ("),
    ]
    for argv, needle in cases:
        status, _, err = _cli(capsys, *argv)
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1, (argv, status, err[-2000:])
        assert lines[0].startswith(f"tpkit {argv[0]}: error: ") and needle in lines[0], \
            (argv, needle, lines)
    assert not (tmp_path / "p").exists() or not list((tmp_path / "p").iterdir())


@pytest.mark.timeout(300)
def test_a_small_corpus_trains_with_a_validation_split(tmp_path, capsys):
    """20,000 tokens (under 20 blocks of 8192: no held-out block before), a tokenizer
    named differently with the same vocabulary: a warning, and the run trains."""
    ids = np.random.default_rng(1).integers(0, 256, 20_000)
    data = _shards(tmp_path / "d", ids, tokenizer=str(tmp_path / "bytes-copy"))
    run = tmp_path / "run folder"  # a space: the "sample it" line quotes it
    status, out, err = _cli(capsys, "train", *TINY, "--out", str(run), "--data", data,
                            "--eval-every", "1")
    assert status == 0, err[-2000:]
    assert f"warning: the data {data} was tokenized with {tmp_path / 'bytes-copy'}" in err
    assert "held-out validation" in out
    sample = next(line for line in out.splitlines() if line.startswith("sample it:"))
    argv = shlex.split(sample.removeprefix("sample it:"))
    assert argv[argv.index("--checkpoint") + 1] == str(run / "checkpoints" / "step_000002")
    assert "--tp" not in argv  # the run's own tp (1): one the model admits


def test_the_split_gives_each_side_a_window():
    for n in (66, 1_000, 16_384, 20_000, 163_839):
        train, val = split_tokens(np.arange(n), 0.05, window=33)
        assert len(val) >= 33 and len(train) >= 33 and len(train) + len(val) == n, n
    train, val = split_tokens(np.arange(65), 0.05, window=33)  # < 2 windows: as asked
    assert len(val) == 3


def _embed_out_of_range(mesh):
    from tpkit.layers.embedding import VocabParallelEmbedding
    from tpkit.spec.errors import UserError

    emb = VocabParallelEmbedding(256, 16, mesh.tp_group)
    out = []
    for ids in ([[1, 2, 300]], [[-1, 5]]):
        try:
            emb(torch.tensor(ids))
            out.append("embedded")
        except UserError as e:
            out.append(str(e))
    return out


@pytest.mark.timeout(120)
def test_the_embedding_refuses_ids_outside_the_vocabulary_on_every_rank(run_tp):
    for said in run_tp(_embed_out_of_range, 2):
        assert said[0].startswith("token id 300 is outside the model's vocabulary "
                                  "(vocab_size=256)"), said
        assert said[1].startswith("token id -1 is outside"), said
