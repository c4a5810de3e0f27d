"""The whole model and its parts against the tp=1 model, with and without sequence
parallelism: logits, loss and every gathered gradient equal to float32 round-off
(max abs diff <= 1e-5), and the ledger equal to the theory per layer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import gather_grads, max_diff
from tpkit.layers.sharding import TPSplit, split_of, splits_of
from tpkit.mesh import ParallelMesh
from tpkit.model import Transformer
from tpkit.model.names import VOCAB_PADDED
from tpkit.spec import ModelConfig, get_preset, theory

B, S = 2, 12
# 6 heads, 3 kv heads, a vocabulary no tp divides: runs at tp = 1, 2 (kv split 3:... no), 3
ODD = ModelConfig(name="odd", vocab_size=250, hidden=48, num_layers=2, num_heads=6,
                  kv_heads=3, ffn=96, max_seq_len=32)
# shapes tp does not divide, split unevenly: SmolLM2-135M's 9 heads / 3 kv heads (kv 1
# on both ranks at tp=2), ffn 100; Qwen2.5-0.5B's 14 heads / 2 kv (at tp=4: 4, 4, 3, 3
# heads, rank 1 holds both kv heads)
SMOL = ModelConfig(name="smol", vocab_size=250, hidden=72, num_layers=2, num_heads=9,
                   kv_heads=3, ffn=100, max_seq_len=32, norm="rmsnorm", activation="swiglu",
                   position="rope", bias=False, tie_embeddings=True)
QWEN = SMOL.with_(name="qwen", hidden=56, num_heads=14, kv_heads=2, ffn=74, attn_bias=True,
                  tie_embeddings=False)
MOE = SMOL.with_(name="moe", num_experts=4, experts_per_token=2)  # a Mixtral-style MLP
SHAPES = {"odd": ODD, "smol": SMOL, "qwen": QWEN, "moe": MOE}


def run_model(mesh, cfg: ModelConfig, sp: bool, ids, labels, recompute=False):
    torch.manual_seed(1234)
    model = Transformer(cfg, mesh, seed=7, sequence_parallel=sp, recompute=recompute)
    token_types = torch.zeros_like(ids) if cfg.type_vocab_size else None
    logits = model(ids, token_types=token_types)
    loss = model.loss(logits, labels)
    loss.backward()
    model.finalize_grads()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return dict(logits=logits.detach(), loss=loss.item(), grads=grads, splits=splits_of(model),
                counts={s: mesh.ledger.counts(scope=s) for s in ("layers.0", "loss", "head")},
                whole=mesh.ledger.counts(phase="forward") + mesh.ledger.counts(phase="backward"),
                bytes={s: mesh.ledger.total(scope=s)["wire_bytes"] for s in ("layers.0",)},
                param_bytes=model.param_bytes())


def unpad(t: torch.Tensor, name: str, vocab: int) -> torch.Tensor:
    """Padded vocabulary rows (embedding, head) differ in count by tp: compare the real ones."""
    return t[:vocab] if name in VOCAB_PADDED else t


def compare(cfg, ref, results, tol=1e-5):
    tp = len(results)
    logits = torch.cat([r["logits"] for r in results], -1)[..., :cfg.vocab_size]
    assert max_diff(logits, ref["logits"][..., :cfg.vocab_size]) <= tol
    assert all(abs(r["loss"] - ref["loss"]) <= tol for r in results)  # same loss on every rank
    grads = gather_grads([r["grads"] for r in results], results[0]["splits"])
    for name, g in ref["grads"].items():
        assert max_diff(unpad(grads[name], name, cfg.vocab_size),
                        unpad(g, name, cfg.vocab_size)) <= tol, (tp, name)


def batch(cfg, seed=0, s=S):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, s), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, s), generator=g)
    labels[0, :2] = -100  # some ignored tokens
    return ids, labels


CASES = [("gpt2-tiny", 2, False), ("gpt2-tiny", 4, False), ("gpt2-tiny", 2, True),
         ("gpt2-tiny", 4, True), ("llama-tiny", 2, False), ("llama-tiny", 4, True),
         ("bert-tiny", 2, False), ("bert-tiny", 4, True), ("odd", 3, False), ("odd", 3, True),
         ("odd", 4, False), ("smol", 2, False), ("smol", 3, False), ("smol", 4, True),
         ("qwen", 4, False), ("qwen", 3, True)]


@pytest.mark.parametrize("preset,tp,sp", CASES)
def test_model_equals_tp1(run_tp, preset, tp, sp):
    cfg = SHAPES[preset] if preset in SHAPES else replace(get_preset(preset), num_layers=2)
    ids, labels = batch(cfg)
    ref = run_model(ParallelMesh.single(), cfg, False, ids, labels)
    results = run_tp(run_model, tp, cfg, sp, ids, labels)
    compare(cfg, ref, results)
    # the ledger: per layer exactly 2 all-reduces of b*s*h each way (or 2 AG + 2 RS)
    h = cfg.hidden
    for r in results:
        assert r["counts"]["layers.0"] == theory.as_counter(theory.layer(B, S, h, tp, sp))
        assert r["counts"]["loss"] == theory.as_counter(theory.cross_entropy(B, S, tp))
        # and the whole step: embedding + layers + head + loss, nothing else
        assert r["whole"] == theory.as_counter(theory.stage(b=B, s=S, h=h, tp=tp, sp=sp,
                                                                num_layers=cfg.num_layers))


def run_models(mesh, jobs):
    """`run_model` for each job (cfg, sp, ids, labels, recompute), one spawn for all."""
    out = []
    for job in jobs:
        mesh.ledger.clear()
        out.append(run_model(mesh, *job))
    return out


# SP on sequences tp does not divide: the residual stream split 4 + 3 (s=7, tp=2) and
# 4 + 3 + 3 (s=10, tp=3); learned positions and token types (each rank its own rows),
# uneven heads too (smol), post-norm BERT, a full recompute (gathers again in backward) and
# a mixture of experts (its router reads the gathered sequence)
UNEVEN_SP = [("gpt2-tiny", False), ("smol", False), ("bert-tiny", False), ("llama-tiny", True),
             ("moe", False)]


@pytest.mark.parametrize("tp,s", [(2, 7), (3, 10)])
def test_sequence_parallel_on_a_sequence_tp_does_not_divide(run_tp, tp, s):
    cfgs = [SHAPES[p] if p in SHAPES else replace(get_preset(p), num_layers=2)
            for p, _ in UNEVEN_SP]
    jobs = [(cfg, True, *batch(cfg, 3, s), rc) for cfg, (_, rc) in zip(cfgs, UNEVEN_SP)]
    short = tp - 1  # fewer tokens than ranks: the last rank's part is empty (1 + 0; 1 + 1 + 0)
    jobs.append((cfgs[0], True, *batch(cfgs[0], 4, short), False))
    results = run_tp(run_models, tp, jobs)
    for j, (cfg, _, ids, labels, rc) in enumerate(jobs):
        ref = run_model(ParallelMesh.single(), cfg, False, ids, labels, rc)
        ranks = [r[j] for r in results]
        compare(cfg, ref, ranks)
        # the ledger: the padded collectives (tp * ceil(s/tp) tokens each), as the theory
        n = ids.shape[1]  # s, or the short job's tp - 1
        h, padded = cfg.hidden, tp * -(-n // tp)
        whole = theory.stage(b=B, s=n, h=h, tp=tp, sp=True, num_layers=cfg.num_layers,
                             recompute="full" if rc else "none")
        for r in ranks:
            assert r["whole"] == theory.as_counter(whole)
            if not rc:  # (a recompute's collectives run outside the layer's scope)
                assert r["counts"]["layers.0"] == theory.as_counter(theory.layer(B, n, h, tp, True))
                assert {n for (_, _, n) in r["counts"]["layers.0"]} == {B * padded * h}
        assert padded != n


@pytest.mark.parametrize("shape,kv,tp", [("llama-tiny", 2, 4), ("llama-tiny", 1, 2),
                                         ("llama-tiny", 1, 4), ("llama-tiny", 4, 2),
                                         ("smol", 3, 2), ("qwen", 2, 4)])
def test_grouped_query_kv_heads_split_or_replicated(run_tp, shape, kv, tp):
    """kv heads read by several ranks' query heads (kv_heads < tp, or query ranges that
    straddle a kv group): every holder keeps them, their gradients summed over holders."""
    cfg = replace(SHAPES.get(shape) or get_preset(shape), num_layers=1, kv_heads=kv)
    ids, labels = batch(cfg, 1)
    ref = run_model(ParallelMesh.single(), cfg, False, ids, labels)
    results = run_tp(run_model, tp, cfg, False, ids, labels)
    compare(cfg, ref, results)
    name = "layers.0.attn.qkv.weight"
    split = results[0]["splits"][name]
    assert split == TPSplit.heads(cfg.num_heads, kv, cfg.head_dim)
    held: dict[int, list[torch.Tensor]] = {}  # global row -> each holder's gradient of it
    for r, res in enumerate(results):
        for pc in split.pieces(r, tp):
            if pc.holders > 1:
                held.setdefault(pc.start, []).append(res["grads"][name][
                    pc.local_start:pc.local_start + pc.size])
    assert bool(held) == (kv < tp or shape != "llama-tiny")
    for start, grads in held.items():
        assert len(grads) > 1 and all(torch.equal(g, grads[0]) for g in grads), start


def test_sequence_parallel_sends_the_same_bytes(run_tp):
    cfg = replace(get_preset("gpt2-tiny"), num_layers=1)
    ids, labels = batch(cfg)
    plain = run_tp(run_model, 2, cfg, False, ids, labels)[0]["bytes"]["layers.0"]
    sp = run_tp(run_model, 2, cfg, True, ids, labels)[0]["bytes"]["layers.0"]
    assert plain == sp > 0


def test_recomputation_gives_the_same_gradients(run_tp):
    cfg = replace(get_preset("gpt2-tiny"), num_layers=2, dropout=0.1)
    ids, labels = batch(cfg)
    for tp in (1, 2):
        plain = run_tp(run_model, tp, cfg, True, ids, labels, False)
        again = run_tp(run_model, tp, cfg, True, ids, labels, True)
        for a, b in zip(plain, again):
            assert a["loss"] == b["loss"]
            for n in a["grads"]:
                assert max_diff(a["grads"][n], b["grads"][n]) <= 1e-6, n


def param_bytes(mesh, cfg):
    m = Transformer(cfg, mesh, device="meta")
    sharded = sum(p.numel() for p in m.parameters() if split_of(p))
    return m.param_bytes(), sharded


def test_parameter_bytes_per_rank_follow_the_formula(run_tp):
    """Per rank: sharded parameters / tp + replicated ones (float32)."""
    cfg = get_preset("gpt2-tiny")
    total1, sharded1 = param_bytes(ParallelMesh.single(), cfg)
    assert total1 == 4 * cfg.num_params()
    for tp in (2, 4):
        total, _ = run_tp(param_bytes, tp, cfg)[0]
        pad = (cfg.padded_vocab(tp) - cfg.vocab_size) * cfg.hidden
        assert total == 4 * ((sharded1 + pad) // tp + (cfg.num_params() - sharded1))


def bad_configs(mesh):
    out = []
    for cfg, sp, seq in [(get_preset("gpt2-tiny").with_(num_heads=3, hidden=60), False, 8),
                         (get_preset("llama-tiny").with_(kv_heads=4, num_heads=12,
                                                             hidden=96), False, 8),
                         (get_preset("gpt2-tiny").with_(hidden=66), False, 8),
                         (get_preset("gpt2-tiny"), True, 6)]:  # SP: 2 + 2 + 1 + 1
        mesh.ledger.clear()
        try:
            m = Transformer(cfg, mesh, sequence_parallel=sp)
            m(torch.zeros(1, seq, dtype=torch.long))
            out.append((None, None))
        except ValueError as e:
            out.append((str(e), len(mesh.ledger.records)))  # nothing sent before the error
    return out


def test_bad_configs_fail_on_every_rank_before_any_collective(run_tp):
    for rank_errors in run_tp(bad_configs, 4):
        errors = [e for e, _ in rank_errors]
        assert all(n == 0 for e, n in rank_errors if e is not None)
        assert "tp=4 is more than num_heads=3 (each rank needs one query head" in errors[0]
        assert errors[1] is None  # 4 kv heads at tp=4: one each
        assert "hidden=66 is not divisible by num_heads=4" in errors[2]
        assert errors[3] is None  # SP on 6 tokens at tp=4: 2, 2, 1, 1 (uneven, exact)
    for rank_errors in run_tp(bad_configs, 3):  # 12 heads / 4 kv at tp=3: kv 1, 2 shared
        assert rank_errors[1] == (None, None)


def test_split_tags_describe_fused_qkv():
    m = Transformer(get_preset("llama-tiny"), ParallelMesh.single())
    s = splits_of(m)["layers.0.attn.qkv.weight"]
    assert s == TPSplit(0, (64, 16, 16), (8, 2, 2), (0, 8, 8)) == TPSplit.heads(8, 2, 8)


def test_published_presets_build_on_the_meta_device_at_their_layouts():
    """llama3-70b at tp=8, pp=2 on a virtual mesh: each rank holds 1/16 of the weights
    (plus replicated norms), without a single process or byte of real memory."""
    cfg = get_preset("llama3-70b")
    per_rank = [Transformer(cfg, ParallelMesh.virtual(tp=8, pp=2, rank=r), device="meta")
                .param_bytes() // 4 for r in (0, 8)]
    assert abs(sum(per_rank) * 8 - cfg.num_params()) / cfg.num_params() < 1e-3
