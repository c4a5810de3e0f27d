"""The chunked head + cross-entropy against the plain path (head matmul, then the
vocab-parallel loss over all logits) and against tp=1: per-token losses, the hidden
states' and the head's gradients equal to float32 round-off (<= 1e-5) at tp = 1, 2, 4,
with and without sequence parallelism, a padded vocabulary, ignored tokens, label
smoothing and a chunk that does not divide the tokens; the ledger holds exactly the
theory's three all-reduces per chunk plus the head's one collective."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import max_diff
from tpkit.comm import ops
from tpkit.layers.chunked_loss import chunked_head_cross_entropy
from tpkit.layers.cross_entropy import vocab_parallel_cross_entropy
from tpkit.layers.linear import column_parallel_linear
from tpkit.mesh import ParallelMesh
from tpkit.model import Transformer
from tpkit.spec import get_preset, theory

B, S, H, VOCAB = 2, 12, 16, 37  # 24 tokens; no tp divides the vocabulary


def head_loss(mesh, h_full, w_full, target, chunk, sp, smoothing):
    """Per-token losses and the gathered grads of h and W, plus the ledger's counts."""
    tp, r, g = mesh.tp_size, mesh.tp_rank, mesh.tp_group
    padded = -(-VOCAB // tp) * tp
    w_pad = torch.cat([w_full, torch.randn(padded - VOCAB, H) * 5])  # padded rows: junk
    w = w_pad.chunk(tp)[r].clone().requires_grad_(True)  # [V/tp, H]
    h = (h_full.chunk(tp, 1)[r] if sp else h_full).clone().requires_grad_(True)
    if chunk:
        loss = chunked_head_cross_entropy(h, w, target, g, VOCAB, chunk=chunk,
                                          sequence_parallel=sp, label_smoothing=smoothing)
    else:
        with g.ledger.scope("head"):
            logits = column_parallel_linear(h, w, None, g, sp)  # [b, s, V/tp]
        with g.ledger.scope("loss"):
            loss = vocab_parallel_cross_entropy(logits, target, g, VOCAB,
                                                label_smoothing=smoothing)
    (loss.sum() / (target != -100).sum()).backward()
    whole = mesh.ledger.counts()
    dh = ops.gather_from_sp(h.grad, g) if sp else h.grad  # [b, s, H]
    return dict(loss=loss.detach(), dh=dh, dw=w.grad, whole=whole)


def data():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(B, S, H, generator=gen)
    w = torch.randn(VOCAB, H, generator=gen) * 0.5
    target = torch.randint(0, VOCAB, (B, S), generator=gen)
    target[0, 1] = target[1, 7] = -100
    return h, w, target


def full_dw(results):
    return torch.cat([r["dw"] for r in results])[:VOCAB]  # [V, H], padding dropped


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_chunked_equals_plain_and_tp1(run_tp, tp, sp, smoothing):
    h, w, target = data()
    ref = head_loss(ParallelMesh.single(), h, w, target, 0, False, smoothing)  # tp=1, plain
    for chunk in (5, 24, 100):  # 5 does not divide 24 tokens; 100 > all of them
        results = run_tp(head_loss, tp, h, w, target, chunk, sp, smoothing)
        plain = run_tp(head_loss, tp, h, w, target, 0, sp, smoothing)
        for r, p in zip(results, plain):
            assert max_diff(r["loss"], ref["loss"]) <= 1e-5
            assert max_diff(r["loss"], p["loss"]) <= 1e-5
            assert max_diff(r["dh"], ref["dh"]) <= 1e-5
            assert max_diff(r["dh"], p["dh"]) <= 1e-5
        assert max_diff(full_dw(results), full_dw([ref])) <= 1e-5
        assert max_diff(full_dw(results), full_dw(plain)) <= 1e-5
        want = theory.head(B, S, H, tp, sp) + theory.cross_entropy(B, S, tp, chunk)
        if not smoothing:  # with smoothing the sum of logits rides in all-reduce 2
            assert all(r["whole"] == theory.as_counter(want) for r in results)
        else:
            assert all(sum(r["whole"].values()) == sum(e.count for e in want) for r in results)


def test_theory_counts_three_all_reduces_per_chunk():
    assert theory.loss_chunks(24, 5) == [5, 5, 5, 5, 4]
    assert theory.loss_chunks(24, 0) == theory.loss_chunks(24, 30) == [24]
    got = theory.as_counter(theory.cross_entropy(2, 12, 2, 5))
    assert got == {("all_reduce", "forward", 5): 12, ("all_reduce", "forward", 4): 3}
    assert theory.cross_entropy(2, 12, 1, 5) == []


def test_chunk_must_be_positive():
    with pytest.raises(ValueError, match="loss_chunk=-3 must be 0"):
        Transformer(get_preset("gpt2-tiny"), ParallelMesh.single(), loss_chunk=-3)
    g = ParallelMesh.single().tp_group
    with pytest.raises(ValueError, match="chunk=0 tokens"):
        chunked_head_cross_entropy(torch.randn(1, 2, 4), torch.randn(8, 4),
                                   torch.zeros(1, 2, dtype=torch.long), g, 8, chunk=0)


def model_step(mesh, cfg, sp, chunk, ids, labels):
    model = Transformer(cfg, mesh, seed=7, sequence_parallel=sp, loss_chunk=chunk)
    loss = model.loss(model(ids), labels)
    loss.backward()
    model.finalize_grads()
    whole = mesh.ledger.counts(phase="forward") + mesh.ledger.counts(phase="backward")
    return dict(loss=loss.item(), whole=whole,
                grads={n: p.grad.clone() for n, p in model.named_parameters()})


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_model_with_chunked_loss_equals_plain(run_tp, tp, sp):
    cfg = replace(get_preset("gpt2-tiny"), num_layers=2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    plain = run_tp(model_step, tp, cfg, sp, 0, ids, labels)
    chunked = run_tp(model_step, tp, cfg, sp, 7, ids, labels)
    for p, c in zip(plain, chunked):
        assert abs(p["loss"] - c["loss"]) <= 1e-5
        for n, g in p["grads"].items():
            assert max_diff(c["grads"][n], g) <= 1e-5, n
        assert c["whole"] == theory.as_counter(
            theory.stage(b=B, s=S, h=cfg.hidden, tp=tp, sp=sp, num_layers=cfg.num_layers,
                         loss_chunk=7))


def train_losses(mesh, out: str, chunk: int) -> dict:
    from tpkit.train.config import TrainConfig
    from tpkit.train.loop import train

    cfg = TrainConfig(preset="gpt2-tiny", tp=mesh.tp_size, pp=mesh.pp_size, steps=3,
                      micro_batches=2, global_batch=8, seq=32, sp=True, loss_chunk=chunk,
                      val_fraction=0.0, out=out, progress=False, plot=False, checkpoint=False)
    r = train(cfg, mesh)
    return dict(losses=r.losses, theory_ok=r.theory_ok)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_training_with_chunked_loss_matches_and_keeps_the_stage_theory(run_tp, tmp_path):
    """tp=2 x pp=2 with SP: 4 x 32 tokens per micro-batch in chunks of 50, 50, 28; the
    step's ledger equals the stage theory (`theory_ok`) on every rank."""
    plain = run_tp(train_losses, 2, str(tmp_path / "plain"), 0, pp=2)
    chunked = run_tp(train_losses, 2, str(tmp_path / "chunked"), 50, pp=2)
    assert all(r["theory_ok"] for r in plain + chunked)
    for p, c in zip(plain, chunked):
        assert max(abs(a - b) for a, b in zip(p["losses"], c["losses"])) <= 1e-5
