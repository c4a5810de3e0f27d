"""Context parallelism changes where the tokens are, not the numbers: cp ranks each hold
two mirrored chunks of every sequence (load-balanced causal work), attention runs as a
ring of k/v blocks merged by online softmax, gradients of k/v come back along the ring;
after 5 AdamW steps from one seed the losses equal the cp=1 run at the same (tp, dp)
(fp32, relative 1e-6) and so do the weights (max |a - b| / max |b| per tensor; see the
bound below), and each step's cp traffic is `tpkit.spec.theory.context_parallel`.

llama-tiny: rotary positions (each chunk rotated by its global positions) and GQA (8
query heads, 2 kv heads: kv travels unrepeated); gpt2-tiny: learned positions.

Why the weights get a looser bound than the losses: the online softmax sums the
sequence in blocks, a different rounding from one softmax; AdamW divides each gradient
by its own running RMS, so an element whose gradient is rounding noise (zero in exact
arithmetic) takes steps of size lr either way, in a direction the rounding picks.
"""

from __future__ import annotations

import pytest
import torch

from tpkit.checkpoint import store
from tpkit.layers.ring_attention import cp_positions
from tpkit.mesh import ParallelMesh
from tpkit.model import Transformer
from tpkit.spec import get_preset
from tpkit.spec.shapes import cp_chunks
from tpkit.train.config import TrainConfig
from tpkit.train.loop import train

WEIGHTS_REL = 1e-3  # see the module doc


def _cfg(out, **kw) -> TrainConfig:
    base = dict(preset="llama-tiny", steps=5, micro_batches=1, global_batch=4, seq=32,
                lr=3e-3, warmup=2, clip=0.5, val_fraction=0.0, out=str(out), progress=False,
                plot=False, checkpoint=True)
    return TrainConfig(**{**base, **kw})


def _train(mesh, cfg: TrainConfig) -> dict:
    r = train(cfg, mesh)
    return dict(losses=r.losses, theory_ok=r.theory_ok, theory=r.theory, ckpt=r.checkpoint)


def _weights(preset: str, ckpt: str) -> dict[str, torch.Tensor]:
    model = Transformer(get_preset(preset), ParallelMesh.single(), seed=123)
    store.load(ckpt, model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _compare(run_tp, tmp_path, preset: str, tp: int, dp: int, cp: int, sp: bool = False,
             pp: int = 1, **extra):
    kw = dict(preset=preset, tp=tp, pp=pp, dp=dp, sp=sp, micro_batches=pp)
    base = run_tp(_train, tp, _cfg(tmp_path / "base", **kw), pp=pp, dp=dp)
    got = run_tp(_train, tp, _cfg(tmp_path / "cp", **kw, cp=cp, **extra), pp=pp, dp=dp, cp=cp)
    assert all(r["theory_ok"] for r in got), got[0]["theory"]  # tp and cp traffic
    assert all(r["losses"] == got[0]["losses"] for r in got)
    loss_rel = max(abs(a - b) / b for a, b in zip(got[0]["losses"], base[0]["losses"]))
    a, b = _weights(preset, got[0]["ckpt"]), _weights(preset, base[0]["ckpt"])
    weight_rel = max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)
    print(preset, dict(tp=tp, pp=pp, dp=dp, cp=cp, **extra), loss_rel, weight_rel)
    assert loss_rel <= 1e-6 and weight_rel <= WEIGHTS_REL, (loss_rel, weight_rel)


def test_chunks_are_mirrored_and_cover_the_sequence():
    spans = [cp_chunks(16, 4, r) for r in range(4)]
    assert spans[0] == [(0, 2), (14, 16)] and spans[3] == [(6, 8), (8, 10)]
    assert sorted(i for s in spans for a, b in s for i in range(a, b)) == list(range(16))
    with pytest.raises(ValueError, match="not divisible by 2\\*cp = 8"):
        cp_chunks(12, 4, 0)


def test_a_model_built_on_a_cp_mesh_rings_over_its_cp_group():
    """The builder takes the cp group from the mesh: nothing patches a built model."""
    from tpkit.layers.attention import ParallelAttention

    for cp in (1, 2):
        mesh = ParallelMesh.virtual(tp=2, pp=1, dp=1, rank=2 * cp - 1, cp=cp)  # the last
        model = Transformer(get_preset("llama-tiny"), mesh, device="meta")
        attn = [m for m in model.modules() if isinstance(m, ParallelAttention)]
        want = mesh.cp_group if cp > 1 else None
        assert attn and all(m.cp is want for m in attn) and model.embed.cp is want
    assert want.ranks == (1, 3) and mesh.cp_rank == 1


@pytest.mark.timeout(180)
def test_ring_attention_forward_and_backward_equal_full_attention(pools):
    results = pools.run(_ring_vs_full, 4, mesh=dict(tp=1, pp=1, dp=1, cp=4))
    assert all(r < 1e-6 for r in results), results


def _ring_vs_full(mesh) -> float:
    """cp=4 ring over the mesh's cp group: output and q/k/v gradients vs one causal softmax."""
    import torch.nn.functional as F

    from tpkit.layers.ring_attention import ring_attention

    g = torch.Generator().manual_seed(0)
    b, hq, hkv, s, d = 2, 4, 2, 16, 8
    q, k, v, dy = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv, hq))
    for t in (q, k, v):
        t.requires_grad_(True)
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                          v.repeat_interleave(2, 1), is_causal=True)
    full.backward(dy)
    pos = cp_positions(s // 4, mesh.cp_group)
    mine = [t.detach()[:, :, pos].clone().requires_grad_(True) for t in (q, k, v)]
    out = ring_attention(*mine, mesh.cp_group)
    out.backward(dy[:, :, pos])
    pairs = [(out, full[:, :, pos])] + [(m.grad, t.grad[:, :, pos]) for m, t in zip(mine, (q, k, v))]
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in pairs)


@pytest.mark.timeout(180)
def test_cp2_rotary_gqa_equals_cp1(run_tp, tmp_path):
    _compare(run_tp, tmp_path, "llama-tiny", 1, 1, 2)


@pytest.mark.timeout(180)
def test_cp2_times_tp2_sp_learned_positions_equals_tp2(run_tp, tmp_path):
    """Heads split over tp, the sequence over tp again inside each cp rank (SP)."""
    _compare(run_tp, tmp_path, "gpt2-tiny", 2, 1, 2, sp=True)


@pytest.mark.timeout(180)
def test_cp2_times_pp2_equals_pp2(run_tp, tmp_path):
    """Pipeline stages pass [b, s/cp, h] activations; each stage's layers ring over cp."""
    _compare(run_tp, tmp_path, "llama-tiny", 1, 1, 2, pp=2)


@pytest.mark.timeout(180)
def test_cp2_with_fsdp_over_dp_times_cp(run_tp, tmp_path):
    """dp=2 x cp=2: the 4 ranks hold the same weights; FSDP shards them over all 4."""
    _compare(run_tp, tmp_path, "llama-tiny", 1, 2, 2, fsdp=True)


def test_bad_layouts_are_named_before_any_process_starts():
    """One line per problem, naming the numbers (UserError, exit 2, on every rank)."""
    from tpkit.spec.errors import UserError

    cases = [(dict(cp=3, seq=32), "seq=32 is not divisible by 2*cp = 6"),
             (dict(zero2=True, fsdp=True), "choose one of zero2 / fsdp"),
             (dict(fsdp=True, fsdp_reshard="never"), "fsdp_reshard='never' is not one of"),
             (dict(fsdp=True, master_weights=True, dtype="bfloat16"), "fsdp with master_weights"),
             (dict(cp=2, preset="bert-tiny"), "cp=2 with a bidirectional model")]
    for kw, says in cases:
        with pytest.raises(UserError, match=says.replace("*", "\\*").replace("(", "\\(")):
            TrainConfig(**{**dict(preset="llama-tiny", seq=32), **kw}).check()
