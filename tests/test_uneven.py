"""Any tp up to the number of heads: shapes tp does not divide, split unevenly, exact.

tp=5 and tp=8 without 8 processes: every rank's module is built in this one process
(a group of tp ranks that sends nothing: the all-reduces are the identity), each
rank's row-parallel output is then its partial sum, and the partial outputs, input
gradients and shared kv gradients are summed by hand. The sums equal the tp=1
module's to float32 round-off: the layout alone (which heads, kv heads and columns
each rank holds) is what is tested. The multi-process runs (tp=2, 3, 4, with the
real collectives and the ledger) are in test_transformer.py and test_linear_mlp.py.
"""

from __future__ import annotations

import pytest
import torch

from helpers import max_diff
from tpkit.comm import collectives as C
from tpkit.comm import ops
from tpkit.comm.group import CommGroup
from tpkit.layers import ParallelMLP
from tpkit.layers.attention import ParallelAttention, heads_of_rank
from tpkit.layers.experts import ParallelMoE
from tpkit.layers.sharding import meta_of
from tpkit.spec import ModelConfig

B, S = 2, 6


class _Done:
    def __init__(self, x):
        self.x = x

    def wait(self):
        return self.x


@pytest.fixture
def silent(monkeypatch):
    """The tp collectives of the layers become the identity (each rank keeps its partial)."""
    monkeypatch.setattr(ops, "reduce_from_tp", lambda x, group: x)
    monkeypatch.setattr(ops, "copy_to_tp", lambda x, group: x)  # (the experts' f)
    monkeypatch.setattr(C, "all_reduce_async", lambda x, group, **kw: _Done(x))


def fake_group(tp: int, rank: int) -> CommGroup:
    return CommGroup(name="tp", ranks=tuple(range(tp)), rank=rank)


def run(make, tp: int, x: torch.Tensor, gy: torch.Tensor) -> dict:
    """Every rank's module: the summed outputs, input gradients and full gradients."""
    y_sum, gx_sum, grads = torch.zeros_like(gy), torch.zeros_like(x), {}
    for rank in range(tp):
        m = make(fake_group(tp, rank) if tp > 1 else CommGroup.single())
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.backward(gy)
        y_sum += y.detach()
        gx_sum += xi.grad
        for name, p in m.named_parameters():
            split = meta_of(p).split
            full = list(p.shape)
            if split is not None:
                full[split.dim] = sum(split.parts)
            g = grads.setdefault(name, torch.zeros(full))
            if split is None:  # replicated: each rank's gradient is partial
                g += p.grad
                continue
            for pc in split.pieces(rank, tp):  # held by `holders` ranks: partials add up
                g.narrow(split.dim, pc.start, pc.size).add_(
                    p.grad.narrow(split.dim, pc.local_start, pc.size))
    return dict(y=y_sum, gx=gx_sum, grads=grads)


def attention_config(heads: int, kv: int, hd: int = 4) -> ModelConfig:
    return ModelConfig(hidden=heads * hd, num_heads=heads, kv_heads=kv, bias=False,
                       attn_bias=True, position="rope", norm="rmsnorm", max_seq_len=16)


# (heads, kv heads, tp): GPT-2's 12 at 5 and 8, SmolLM2's 9 / 3, Qwen2.5's 14 / 2
CASES = [(12, 12, 5), (12, 12, 8), (9, 3, 5), (9, 3, 8), (14, 2, 8), (14, 2, 5), (9, 9, 9),
         (12, 4, 5)]


@pytest.mark.parametrize("heads,kv,tp", CASES)
def test_attention_at_any_tp_sums_to_tp1(silent, heads, kv, tp):
    c = attention_config(heads, kv)
    g = torch.Generator().manual_seed(heads * 100 + tp)
    x, gy = torch.randn(B, S, c.hidden, generator=g), torch.randn(B, S, c.hidden, generator=g)
    make = lambda group: ParallelAttention(c, group, seed=11)  # noqa: E731
    ref, got = run(make, 1, x, gy), run(make, tp, x, gy)
    assert max_diff(got["y"], ref["y"]) <= 1e-5
    assert max_diff(got["gx"], ref["gx"]) <= 1e-5
    for name, want in ref["grads"].items():
        assert max_diff(got["grads"][name], want) <= 1e-5, name


@pytest.mark.parametrize("ffn,tp", [(100, 8), (29, 5), (1536 // 16, 5)])
def test_mlp_at_any_tp_sums_to_tp1(silent, ffn, tp):
    g = torch.Generator().manual_seed(ffn)
    x, gy = torch.randn(B, S, 16, generator=g), torch.randn(B, S, 16, generator=g)
    make = lambda group: ParallelMLP(16, ffn, group, activation="swiglu", bias=False,  # noqa: E731
                                     seed=5)
    ref, got = run(make, 1, x, gy), run(make, tp, x, gy)
    assert max_diff(got["y"], ref["y"]) <= 1e-5
    assert max_diff(got["gx"], ref["gx"]) <= 1e-5
    for name, want in ref["grads"].items():
        assert max_diff(got["grads"][name], want) <= 1e-5, name


@pytest.mark.parametrize("ep,experts,tp", [(False, 3, 5), (True, 5, 3), (True, 4, 3)])
def test_experts_at_any_tp_sum_to_tp1(silent, ep, experts, tp):
    """Each expert's ffn 29 over tp=5 (6 + 4 x 5 columns), or whole experts over tp=3
    (5 experts: 2 + 2 + 1; 4: 2 + 1 + 1)."""
    g = torch.Generator().manual_seed(experts)
    x, gy = torch.randn(B, S, 16, generator=g), torch.randn(B, S, 16, generator=g)
    make = lambda group: ParallelMoE(16, 29, group, num_experts=experts,  # noqa: E731
                                     expert_parallel=ep and group.size > 1, seed=5)
    ref, got = run(make, 1, x, gy), run(make, tp, x, gy)
    assert max_diff(got["y"], ref["y"]) <= 1e-5
    assert max_diff(got["gx"], ref["gx"]) <= 1e-5
    for name, want in ref["grads"].items():
        assert max_diff(got["grads"][name], want) <= 1e-5, name


def test_without_summing_the_shared_kv_gradients_it_would_not_match(silent):
    """The hand sum above is what the tp sum does: one holder's kv gradient alone is
    not the tp=1 gradient (so the test can fail)."""
    c = attention_config(9, 3)
    x, gy = torch.randn(B, S, c.hidden), torch.randn(B, S, c.hidden)
    ref = run(lambda group: ParallelAttention(c, group, seed=11), 1, x, gy)
    m = ParallelAttention(c, fake_group(2, 1), seed=11)
    m(x).backward(gy)
    q_rows, kv1 = 4 * 4, slice(9 * 4 + 4, 9 * 4 + 8)  # rank 1: 4 query heads, then kv 1, 2
    assert max_diff(m.qkv.weight.grad[q_rows:q_rows + 4], ref["grads"]["qkv.weight"][kv1]) > 1e-3


def test_heads_dealt_as_evenly_as_possible():
    assert [heads_of_rank(9, 3, 2, r) for r in range(2)] == [
        ([0, 1, 2, 3, 4], [0, 1]), ([5, 6, 7, 8], [1, 2])]
    assert [len(heads_of_rank(14, 2, 4, r)[0]) for r in range(4)] == [4, 4, 3, 3]
    assert [heads_of_rank(14, 2, 4, r)[1] for r in range(4)] == [[0], [0, 1], [1], [1]]
    assert [len(heads_of_rank(12, 12, 5, r)[0]) for r in range(5)] == [3, 3, 2, 2, 2]


# -- training: tp=2 x pp=2 on 9 heads / 3 kv heads and ffn 99, resumed bit for bit -------
def _train(mesh, cfg, model_cfg) -> list[float]:
    from tpkit.model import Transformer
    from tpkit.train.loop import train

    return train(cfg, mesh, Transformer(model_cfg, mesh, seed=cfg.seed)).losses


@pytest.mark.timeout(180)
def test_uneven_training_at_tp2_pp2_resumes_bit_for_bit(run_tp, tmp_path):
    from tpkit.spec import get_preset
    from tpkit.train.config import TrainConfig

    model = get_preset("gpt2-tiny").with_(num_layers=2, num_heads=9, kv_heads=3, head_dim=8,
                                          ffn=99)
    base = dict(preset="gpt2-tiny", steps=6, micro_batches=2, global_batch=8, seq=16, lr=3e-3,
                warmup=2, clip=0.5, val_fraction=0.0, progress=False, plot=False, tp=2, pp=2)
    whole = run_tp(_train, 2, TrainConfig(**base, out=str(tmp_path / "a"), checkpoint=True,
                                          ckpt_every=3), model, pp=2)
    losses = whole[0]
    assert all(r == losses for r in whole) and losses[-1] < losses[0]
    step3 = tmp_path / "a" / "checkpoints" / "step_000003"
    again = run_tp(_train, 2, TrainConfig(**base, out=str(tmp_path / "b"), checkpoint=False,
                                          resume=str(step3)), model, pp=2)
    assert again[0] == losses[3:]  # bit for bit: same layout, same reductions
    other = run_tp(_train, 3, TrainConfig(**{**base, "tp": 3, "pp": 1}, out=str(tmp_path / "c"),
                                          checkpoint=False, resume=str(step3)), model)
    assert max(abs(a - b) / b for a, b in zip(other[0], losses[3:])) <= 1e-4  # 3 + 3 + 3 heads


# -- the planner: the largest rank sets the step time and the memory --------------------
def test_planner_charges_the_largest_rank():
    from tpkit.plan import get_hardware
    from tpkit.plan.memory import Precision
    from tpkit.plan.reasons import explain
    from tpkit.plan.simulate import Cluster, Layout, evaluate, layer_times
    from tpkit.spec import get_preset

    smol = get_preset("llama3.2-1b").with_(num_heads=9, kv_heads=3, head_dim=64, hidden=576,
                                           ffn=1536, num_layers=30)  # SmolLM2-135M's shape
    assert smol.tp_shares(2)["attention"] == 5 / 9
    assert smol.tp_shares(3) == {"attention": 1 / 3, "gemm": 1 / 3}
    assert smol.layer_params(2) == smol.layer_params(2, rank=0) > smol.layer_params(2, rank=1)
    cluster = Cluster(get_hardware("h100"), nodes=1, devices_per_node=2)
    even, uneven = (evaluate(smol.with_(num_heads=n), 2048, 8, Layout(2, 1, 1, 1), cluster)
                    for n in (8, 9))  # 8 heads: the same 4 b s^2 h attention, split evenly
    assert uneven.notes["tp_imbalance"] == pytest.approx(1 / 9) and even.notes[
        "tp_imbalance"] == 0
    bf16 = Precision.for_dtype("bfloat16")
    lt = {n: layer_times(smol.with_(num_heads=n), 2048, Layout(2, 1, 1, 1), cluster.profile,
                         bf16) for n in (8, 9)}
    assert lt[9]["attention_fwd"] > 1.05 * lt[8]["attention_fwd"]
    assert uneven.step_time_s > even.step_time_s
    why = explain(uneven, even, smol, 2048, cluster)
    assert "tp=2 on 9 heads: the larger rank does 5/9 of the attention, 11% above an even " \
        "split" in why, why


@pytest.mark.timeout(180)
def test_context_parallel_with_uneven_kv_groups_equals_cp1(run_tp, tmp_path):
    """tp=2 x cp=2 on 9 heads / 3 kv: rank 0's query heads 0-4 read kv 0, 0, 0, 1, 1 (not
    a plain repeat): its keys travel the ring once per query head; the losses are the
    cp=1 run's and the ring traffic is the theory's."""
    from tpkit.spec import get_preset
    from tpkit.train.config import TrainConfig

    model = get_preset("llama-tiny").with_(num_layers=2, num_heads=9, kv_heads=3, head_dim=8,
                                           ffn=99)
    base = dict(preset="llama-tiny", steps=3, micro_batches=1, global_batch=4, seq=32, lr=3e-3,
                warmup=1, val_fraction=0.0, progress=False, plot=False, checkpoint=False, tp=2)
    plain = run_tp(_train_checked, 2, TrainConfig(**base, out=str(tmp_path / "a")), model)
    ring = run_tp(_train_checked, 2, TrainConfig(**base, cp=2, out=str(tmp_path / "b")), model,
                  dp=2)
    assert all(ok for _, ok in ring), "ledger = theory under cp"
    rel = max(abs(a - b) / b for a, b in zip(ring[0][0], plain[0][0]))
    assert rel <= 1e-6, rel


def _train_checked(mesh, cfg, model_cfg) -> tuple[list[float], bool]:
    from tpkit.model import Transformer
    from tpkit.train.loop import train

    r = train(cfg, mesh, Transformer(model_cfg, mesh, seed=cfg.seed))
    return r.losses, r.theory_ok
