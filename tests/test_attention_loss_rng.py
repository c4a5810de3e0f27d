"""Attention (masks, RoPE), vocab-parallel cross-entropy and the tensor-parallel RNG."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import gather_grads, max_diff, splits_of
from tpkit.layers import finalize_tp_grads
from tpkit.layers.attention import ParallelAttention
from tpkit.layers.cross_entropy import vocab_parallel_cross_entropy
from tpkit.layers.random import TPRandom, dropout
from tpkit.mesh import ParallelMesh
from tpkit.spec import theory
from tpkit.spec.config import ModelConfig

B, S, H = 2, 6, 32


def attend(mesh, opts, x, mask, gy):
    torch.manual_seed(0)
    a = ParallelAttention(ModelConfig(hidden=H, num_heads=4, **opts), mesh.tp_group, seed=11)
    xi = x.clone().requires_grad_(True)
    y = a(xi, mask)
    y.backward(gy)
    finalize_tp_grads(a, mesh.tp_group)  # shared kv heads (kv < tp): sum their gradients
    counts = mesh.ledger.counts(phase="forward") + mesh.ledger.counts(phase="backward")
    return dict(y=y.detach(), gx=xi.grad, splits=splits_of(a), heads=a.owned_heads(),
                grads={n: p.grad.clone() for n, p in a.named_parameters()},
                counts=counts)


@pytest.mark.parametrize("opts,padded", [
    (dict(causal=True), False), (dict(causal=False), True), (dict(causal=True), True),
    (dict(position="rope", kv_heads=2, bias=False), True),
    (dict(position="rope", kv_heads=1), False)])
def test_attention_equals_tp1(run_tp, opts, padded):
    g = torch.Generator().manual_seed(3)
    x, gy = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    if padded:
        mask[1, -2:] = 0  # right padding on the second sequence
    ref = attend(ParallelMesh.single(), opts, x, mask if padded else None, gy)
    for tp in (2, 4):
        results = run_tp(attend, tp, opts, x, mask if padded else None, gy)
        assert max_diff(results[0]["y"], ref["y"]) <= 1e-5
        assert max_diff(results[0]["gx"], ref["gx"]) <= 1e-5
        grads = gather_grads([r["grads"] for r in results], results[0]["splits"])
        for n, gr in ref["grads"].items():
            assert max_diff(grads[n], gr) <= 1e-5, n
        assert results[0]["counts"] == theory.as_counter(theory.attention(B, S, H, tp))
        # quiz answer 4: the query heads are partitioned, each rank a subset
        owned = [r["heads"][0] for r in results]
        assert sorted(h for q in owned for h in q) == list(range(4))
        assert all(len(q) == 4 // tp for q in owned)


def ce(mesh, logits_full, target, vocab, smoothing, ignore):
    tp, r = mesh.tp_size, mesh.tp_rank
    padded = -(-vocab // tp) * tp
    full = torch.cat([logits_full, torch.randn(*logits_full.shape[:-1], padded - vocab) * 50], -1)
    local = full.chunk(tp, -1)[r].clone().requires_grad_(True)  # padded columns: junk values
    loss = vocab_parallel_cross_entropy(local, target, mesh.tp_group, vocab, ignore_index=ignore,
                                        label_smoothing=smoothing)
    n = (target != ignore).sum()
    (loss.sum() / n).backward()
    return loss.detach(), local.grad, mesh.ledger.counts()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_cross_entropy_matches_torch(run_tp, tp, smoothing):
    vocab = 37  # no tp divides it: the vocabulary is padded
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(B, S, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (B, S), generator=g)
    target[0, 1] = target[1, 4] = -100
    want = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100,
                           label_smoothing=smoothing, reduction="none")
    lg = logits.clone().requires_grad_(True)
    F.cross_entropy(lg.transpose(1, 2), target, ignore_index=-100,
                    label_smoothing=smoothing).backward()
    results = run_tp(ce, tp, logits, target, vocab, smoothing, -100)
    for loss, _, counts in results:
        assert max_diff(loss, want) <= 1e-5
        if not smoothing:
            assert counts == theory.as_counter(theory.cross_entropy(B, S, tp))
        else:  # the global sum of logits rides in the target-logit all-reduce
            assert sum(counts.values()) == 3
    grad = torch.cat([g_ for _, g_, _ in results], -1)
    assert max_diff(grad[..., :vocab], lg.grad) <= 1e-6
    assert grad[..., vocab:].abs().max() == 0  # padded columns get no gradient


def test_cross_entropy_rejects_gathered_logits():
    group = ParallelMesh.single().tp_group
    from tpkit.comm.group import CommGroup

    fake = CommGroup("tp", (0, 1), 0, None, group.ledger)  # tp=2, no collective reached
    with pytest.raises(ValueError, match="look already gathered"):
        vocab_parallel_cross_entropy(torch.randn(2, 3, 38), torch.zeros(2, 3, dtype=torch.long),
                                     fake, 37)


def masks(mesh):
    rng = TPRandom(seed=9, tp_rank=mesh.tp_rank)
    torch.manual_seed(100)  # the default generator: seeded alike on every tp rank
    ones = torch.ones(64)
    replicated = dropout(ones, 0.5, True, rng, sharded=False) != 0
    sharded = dropout(ones, 0.5, True, rng, sharded=True) != 0
    return replicated, sharded


def test_dropout_masks_differ_on_sharded_and_match_on_replicated(run_tp):
    results = run_tp(masks, 2)
    (rep0, sh0), (rep1, sh1) = results
    assert torch.equal(rep0, rep1)
    assert not torch.equal(sh0, sh1)
