"""The loader: dp replicas read disjoint windows, tp ranks (and pp stages: it reads only
mesh.dp_rank) of one replica
read the same batch, labels are the inputs shifted by one, and the position in the
stream is the whole state: a loader restored from it continues with the same batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpkit.train.data import (
    TokenLoader,
    embedded_text,
    load_tokens,
    micro_batches,
    split_tokens,
)
from tpkit.weights.tokenizer import ByteTokenizer


def _batches(mesh, n: int) -> list:
    tokens = load_tokens(None)
    loader = TokenLoader(tokens, seq=16, global_batch=8, dp_rank=mesh.dp_rank,
                         dp_size=mesh.dp_size, seed=3)
    return [(mesh.dp_rank, loader.window_ids(loader.position), loader.next_batch()[0])
            for _ in range(n)]


@pytest.mark.timeout(60)
def test_dp_disjoint_tp_identical(run_tp):
    per_rank = run_tp(_batches, 2, 3, pp=1, dp=2)  # ranks 0,1: dp0; ranks 2,3: dp1
    for step in range(3):
        (d0, w0, x0), (_, _, x1), (d1, w2, x2), (_, _, x3) = (r[step] for r in per_rank)
        assert (d0, d1) == (0, 1)
        assert torch.equal(x0, x1) and torch.equal(x2, x3)  # same batch on every tp rank
        assert not set(w0) & set(w2)  # replicas read different windows
        assert x0.shape == (4, 16)


def test_embedded_corpus_is_pydoc_text():
    tokens = load_tokens(None)
    assert 400_000 < len(tokens) < 2_000_000 and int(tokens.max()) < 256
    assert "Python" in ByteTokenizer().decode(tokens[:20000])
    assert ByteTokenizer().decode(tokens[:200]) == embedded_text().encode()[:200].decode(errors="replace")


def test_labels_are_inputs_shifted_and_microbatches_split():
    tokens = np.arange(1000, dtype=np.uint16) % 256
    ids, labels = TokenLoader(tokens, seq=10, global_batch=4, shuffle=False).next_batch()
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    mbs = micro_batches(ids, labels, 2)
    assert [m.ids.shape for m in mbs] == [(2, 10), (2, 10)]


def test_resumption_from_state():
    tokens = load_tokens(None)
    a = TokenLoader(tokens, seq=32, global_batch=8, dp_rank=1, dp_size=2, seed=5)
    for _ in range(7):
        a.next_batch()
    state = a.state_dict()
    assert state["position"] == 7 * 8
    b = TokenLoader(tokens, seq=32, global_batch=8, dp_rank=1, dp_size=2, seed=5)
    b.load_state_dict(state)
    for _ in range(3):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    with pytest.raises(ValueError, match=r"--seed must stay 5 on resume \(given: 6\); start a "
                                         r"new run \(another --out\) to change it"):
        TokenLoader(tokens, seq=32, global_batch=8, seed=6).load_state_dict(state)


def test_epochs_reshuffle_and_cover_every_window():
    tokens = np.arange(101, dtype=np.uint16)
    loader = TokenLoader(tokens, seq=10, global_batch=5, seed=1)  # 10 windows
    first = loader.window_ids(0) + loader.window_ids(5)
    second = loader.window_ids(10) + loader.window_ids(15)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second


def test_user_data_text_bin_and_split(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "t.bin")
    assert ByteTokenizer().decode(load_tokens(tmp_path / "a.txt")[:5]) == "hello"
    assert len(load_tokens(tmp_path)) == 600  # a directory: its .txt files
    assert load_tokens(tmp_path / "t.bin", vocab_size=512)[-1] == 299
    train, val = split_tokens(np.arange(100), 0.1)  # short: the tail
    assert len(train) == 90 and list(val) == list(range(90, 100))
    train, val = split_tokens(np.arange(100), 0.25, block=10)  # every 4th block of 10
    assert list(val) == list(range(30, 40)) + list(range(70, 80)) and len(train) == 80


def test_bad_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokens(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_tokens(tmp_path / "empty.txt")
    np.array([7, 300], dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match="token id 300 .* vocab_size=256"):
        load_tokens(tmp_path / "big.bin")
    with pytest.raises(ValueError, match="fewer than global_batch=8"):
        TokenLoader(np.arange(50, dtype=np.uint16), seq=10, global_batch=8)
