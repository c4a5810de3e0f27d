"""FSDP's two resharding modes in the planner: after-forward (FSDP2's default: weights
gathered for every micro-batch's forward and backward, gradients reduce-scattered every
micro-batch) and after-step (gathered once per step and kept, gradients accumulated
unsharded and reduce-scattered once), with interleaving as Llama 3 ran it. Pure Python."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tpkit.cli import main as tpkit_main
from tpkit.plan import PlanError, Request, get_hardware, papers, plan
from tpkit.plan.command_line import megatron_flags
from tpkit.plan.cost import all_gather_time, reduce_scatter_time
from tpkit.plan.hardware import LINKS
from tpkit.plan.memory import params_per_rank, stage_params
from tpkit.plan.simulate import Cluster, Layout, evaluate, replica_link
from tpkit.spec import theory
from tpkit.spec.config import get_preset

N, DP, M = 1000, 8, 16  # parameters of one rank, dp ranks, micro-batches per step


def _wire(expects: list[theory.Expect]) -> float:
    """Elements each rank sends over a ring, all collectives of the list."""
    return sum(e.count * e.numel * theory.ring_factor(e.op, DP) for e in expects)


def test_after_forward_gathers_twice_and_reduces_every_micro_batch():
    got = theory.as_counter(theory.fully_sharded(N, DP, M))  # FSDP2's default
    assert got == {("all_gather", "forward", N): M, ("all_gather", "backward", N): M,
                   ("reduce_scatter", "grads", N): M}
    assert _wire(theory.fully_sharded(N, DP, M)) == pytest.approx(3 * M * (DP - 1) / DP * N)


def test_after_step_gathers_and_reduces_once_per_step_whatever_the_micro_batches():
    for m in (1, 4, M):
        got = theory.as_counter(theory.fully_sharded(N, DP, m, "after-step"))
        assert got == {("all_gather", "forward", N): 1, ("reduce_scatter", "grads", N): 1}
    # one gather + one reduce-scatter: the bytes of ZeRO-1's step, of one all-reduce
    step = theory.fully_sharded(N, DP, M, "after-step")
    assert _wire(step) == pytest.approx(_wire(theory.data_parallel(N, DP)))
    assert _wire(step) == pytest.approx(_wire(theory.fully_sharded(N, DP, M)) / (1.5 * M))
    assert theory.fully_sharded(N, 1, M, "after-step") == []  # nothing to share with dp = 1


def test_a_reshard_mode_that_does_not_exist_is_named():
    with pytest.raises(ValueError, match="'after-backward' is not one of"):
        theory.fully_sharded(N, DP, M, "after-backward")
    with pytest.raises(ValueError, match="fsdp_reshard='never'"):
        Layout(1, 1, 8, 1, zero=3, fsdp_reshard="never")


def _llama8b(reshard: str, interleave: int = 1, pp: int = 2, overlap: bool = True):
    c = get_preset("llama3-8b")
    cluster = Cluster(get_hardware("h100"), nodes=4, overlap_dp=overlap)
    lay = Layout(2, pp, 32 // (2 * pp), 1, True, "selective", 3, interleave,
                 fsdp_reshard=reshard)
    return c, lay, cluster, evaluate(c, 4096, 256, lay, cluster)


def test_planner_prices_fsdp_traffic_from_the_spec_counts():
    """Without overlap the dp term is the ring price of the spec's list: m x (2 AG + RS)
    after-forward, AG + RS after-step, of the fullest stage's weights and fp32 gradients."""
    for reshard, rounds in (("after-forward", None), ("after-step", 1)):
        c, lay, cluster, e = _llama8b(reshard, overlap=False)
        m = rounds or e.micro_batches
        params = max(stage_params(c, lay, s) for s in range(lay.pp))
        link = replica_link(lay, cluster.profile)
        ag = all_gather_time(2 * params, lay.replicas, link)
        rs = reduce_scatter_time(4 * params, lay.replicas, link)
        assert e.terms["dp"] == pytest.approx(m * ((1 if rounds else 2) * ag + rs))
    # interleaving does not add gathers: each chunk is gathered once, the stage once in all
    assert _llama8b("after-step", 2, overlap=False)[3].terms["dp"] == pytest.approx(
        _llama8b("after-step", 1, overlap=False)[3].terms["dp"])


def test_after_step_memory_adds_the_stage_weights_and_gradients_it_keeps():
    c = get_preset("llama3-8b")
    cluster = Cluster(get_hardware("h100"), nodes=2)
    step, fwd = (evaluate(c, 4096, 64, Layout(2, 1, 8, 1, True, zero=3, fsdp_reshard=r),
                          cluster).memory for r in ("after-step", "after-forward"))
    stage, layer = params_per_rank(c, 2, 1, 0), c.layer_params(2)  # tp-sharded, gathered
    assert step["weights"] - fwd["weights"] == pytest.approx(2 * (stage - 2 * layer))
    # after-step: the stage's gradients unsharded, beside one unit's shard (the shards
    # replace them unit by unit in the last backward); after-forward: shards + one layer
    assert step["grads"] == pytest.approx(4 * (stage + layer / 8))
    assert fwd["grads"] == pytest.approx(4 * (stage / 8 + layer))
    assert step["optimizer"] == fwd["optimizer"] and step["activations"] == fwd["activations"]
    # so the gathered weights are the whole stage's, plus the 1/dp shard at rest
    assert step["weights"] == pytest.approx(2 * stage * (1 + 1 / 8))


def _llama3_405b(zero: int, reshard: str, interleave: int):
    gpus, tp, cp, pp, dp, seq, gbs, tflops, _ = papers.LLAMA3_TABLE4[0]
    hw = get_hardware("h100")
    roce = replace(hw, inter=LINKS["roce-400"])
    lay = Layout(tp, pp, dp, 1, True, "none", zero, interleave, cp, lighter_ends=True,
                 fsdp_reshard=reshard)
    c = get_preset("llama3-405b")
    return evaluate(c, seq, gbs, lay, Cluster(roce, nodes=gpus // 8)), tflops


def test_llama3_405b_as_published_is_within_ten_percent_once_weights_are_kept():
    """Table 4's 8,192-GPU run (430 TFLOP/s): the planner's FSDP2-default pricing put it at
    less than half; with the weights gathered once per step and the interleaving the
    paper implies (v = 8) it lands within 10%. Memory does not fit: see docs/planner.md."""
    before, published = _llama3_405b(3, "after-forward", 1)
    after, _ = _llama3_405b(3, "after-step", papers.LLAMA3_INTERLEAVE)
    assert before.tflops_per_device < 0.5 * published
    assert abs(after.tflops_per_device / published - 1) < 0.10
    assert after.terms["dp"] < 0.05 * before.terms["dp"]  # 1 AG + 1 RS instead of 32 x 3
    assert after.memory["total"] > get_hardware("h100").accelerator.memory_bytes > \
        before.memory["total"]


def _searched(row: tuple, kernels: str = papers.LLAMA3_KERNELS) -> tuple:
    """`tpkit plan`'s pick for a table 4 row given what the paper states (tp, cp, pp, dp,
    one sequence a micro-batch, no recomputation), the rest left to the search, with the
    activations of `kernels`; and the paper's layout priced on the same cluster."""
    gpus, tp, cp, pp, dp, seq, gbs, tflops, _ = row
    roce = replace(get_hardware("h100"), inter=LINKS["roce-400"])
    cl = Cluster(roce, nodes=gpus // 8, kernels=kernels)
    c = get_preset("llama3-405b").with_(max_seq_len=seq)
    fixed = dict(tp=tp, cp=cp, pp=pp, dp=dp, micro_batch=1, recompute="none")
    paper = Layout(tp, pp, dp, 1, True, "none", 2, papers.LLAMA3_INTERLEAVE, cp, True)
    return plan(Request(c, seq, gbs, cl, fixed))[0], evaluate(c, seq, gbs, paper, cl), tflops


@pytest.mark.parametrize("row", papers.LLAMA3_TABLE4, ids=lambda r: f"{r[0]}-gpus-seq-{r[5]}")
def test_llama3_405b_searched_is_within_twenty_percent(row):
    """The search tries every interleaving that splits the layers evenly and both FSDP
    reshardings, a per-micro-batch reduce-scatter hides behind a forward and a backward,
    and Meta's SwiGLU keeps gate|up only: the paper's layout (v = 8) fits in the card's
    usable 90% on all three runs, and the pick is interleaved and within 20%. With
    Megatron-Core's SwiGLU (which keeps silu(gate) * up too) the 8,192-GPU run's stage 1
    holds 141 one-layer chunks of 533 MB, over 90% of the card: the search then fell back
    to v = 1 and missed by 25% (docs/planner.md)."""
    best, paper, published = _searched(row)
    assert abs(paper.tflops_per_device / published - 1) < 0.20
    assert paper.fits and best.fits
    assert best.layout.interleave == papers.LLAMA3_INTERLEAVE
    assert abs(best.tflops_per_device / published - 1) < 0.20
    if row[0] == 8192:
        _, megatron, _ = _searched(row, "fused")
        assert not megatron.fits  # the card's "80 GB" are 85.5e9 bytes: over 90% of them
        assert megatron.memory["total"] < get_hardware("h100").accelerator.memory_bytes


def test_meta_swiglu_saves_one_ffn_tensor_per_chunk_in_flight():
    """The 8,192-GPU run's fullest rank, part by part: Meta's kernels change only the
    activations, by one s x ffn/tp bf16 tensor (silu(gate) * up) for each one-layer chunk
    stage 1 holds at the interleaved schedule's peak."""
    gpus, tp, cp, pp, dp, seq, gbs, _, _ = papers.LLAMA3_TABLE4[0]
    _, xformers, _ = _searched(papers.LLAMA3_TABLE4[0])
    _, megatron, _ = _searched(papers.LLAMA3_TABLE4[0], "fused")
    chunks = theory.peak_in_flight(1, pp, papers.LLAMA3_INTERLEAVE, gbs // dp)
    ffn = get_preset("llama3-405b").ffn
    for part in ("weights", "grads", "optimizer"):
        assert xformers.memory[part] == megatron.memory[part]
    saved = megatron.memory["activations"] - xformers.memory["activations"]
    assert saved == pytest.approx(chunks * seq * ffn // tp * 2)
    assert xformers.step_time_s == megatron.step_time_s  # the product is recomputed in the
    # backward's own fused kernel, which reads gate|up anyway: priced as the same time


def test_a_reduce_scatter_per_micro_batch_hides_behind_a_forward_and_a_backward():
    """ZeRO-2's m reduce-scatters: each one's window runs until the next is issued (the
    next micro-batch's forward, or another chunk's, and its backward); the last one has
    only its backward. Priced by the spec's ring of the stage's gradients."""
    from tpkit.plan.data_parallel import dp_time
    link = LINKS["ib-ndr"]
    lay = Layout(1, 1, DP, 1, zero=2)
    rs = reduce_scatter_time(N * 4, DP, link)
    ag = all_gather_time(N * 2, DP, link)
    fwd, bwd = 0.4 * rs, 0.8 * rs  # rs outlasts a backward, not a forward + backward
    got = dp_time(N, 1, lay, link, 4, 2, M, fwd, bwd)
    assert got == pytest.approx((rs - bwd) + ag)  # only the last one shows
    assert dp_time(N, 1, lay, link, 4, 2, M, fwd, bwd, overlap=False) == pytest.approx(
        M * rs + ag)


def test_llama3_layout_gives_valid_megatron_flags():
    lay = Layout(8, 16, 64, 1, True, "none", 3, 8, lighter_ends=True, fsdp_reshard="after-step")
    flags = megatron_flags(lay, 8192, 2048, 126)
    assert ("--num-virtual-stages-per-pipeline-rank 8 --account-for-embedding-in-pipeline-split "
            "--account-for-loss-in-pipeline-split") in flags
    assert "--num-layers-per-virtual-pipeline-stage" not in flags  # 126 // 128 would be 0
    assert "--decoder-first-pipeline-num-layers" not in flags


def test_pinned_interleaving_must_split_the_layers_evenly():
    c = get_preset("llama3-405b")
    cluster = Cluster(get_hardware("h100"), nodes=1024)
    fixed = {"tp": 8, "pp": 16, "cp": 1, "micro_batch": 1, "sp": True, "zero": 3,
             "recompute": "full", "fsdp_reshard": "after-step"}
    plans = plan(Request(c, 8192, 2048, cluster, {**fixed, "interleave": 8}), distinct=False)
    assert {(e.layout.interleave, e.layout.lighter_ends) for e in plans} == {(8, True)}
    assert all(e.layout.fsdp_reshard == "after-step" for e in plans)
    with pytest.raises(PlanError, match="126 layers .* do not split into 16 x 3"):
        plan(Request(c, 8192, 2048, cluster, {**fixed, "interleave": 3}))


def _run(capsys, argv: list[str]) -> str:
    assert tpkit_main(argv) == 0
    return capsys.readouterr().out


def test_command_line_option_help_table_and_json(capsys):
    with pytest.raises(SystemExit):
        tpkit_main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--fsdp-reshard {after-forward,after-step}" in text
    assert "reshard_after_forward=True" in text and "reshard_after_forward=False" in text
    argv = ["plan", "--preset", "llama3-8b", "--nodes", "2", "--zero", "3", "--top", "1"]
    out = _run(capsys, [*argv, "--fsdp-reshard", "after-step"])
    assert "fsdp-step" in out and "set_requires_gradient_sync(False)" in out
    assert "--data-parallel-sharding-strategy optim_grads_params" in out
    best = json.loads(_run(capsys, [*argv, "--fsdp-reshard", "after-step", "--json"]))[0]
    assert best["fsdp_reshard"] == "after-step" and best["commands"]["note"]
    assert best["memory_breakdown_gb"]["grads"] > best["memory_breakdown_gb"]["optimizer"]
    pinned = json.loads(_run(capsys, [*argv, "--fsdp-reshard", "after-forward", "--json"]))[0]
    assert pinned["fsdp_reshard"] == "after-forward" and pinned["commands"]["note"] is None
    default = json.loads(_run(capsys, [*argv, "--json"]))[0]  # searched: the faster that fits
    assert default["step_time_s"] <= min(pinned["step_time_s"], best["step_time_s"])


def test_cpu_and_local_profiles_predict_tpkits_eager_block():
    """On a CPU (or calibrated local) profile the plan is for tpkit itself: activations of
    its eager block (unfused RMSNorm and SwiGLU, GQA's k/v repeated), which
    benchmarks/memory_sharded.py measures within 3%; GPU profiles keep Megatron's fused
    kernels."""
    from tpkit.plan.memory import Precision, stage_activation_bytes

    c, lay = get_preset("llama-tiny"), Layout(1, 1, 2, 4, recompute="none")
    prec = Precision.for_dtype("fp32")
    for hw, kernels in (("cpu", "eager"), ("h100", "fused")):
        got = evaluate(c, 128, 8, lay, Cluster(get_hardware(hw), 1, 2), prec).memory
        want = stage_activation_bytes(c, 128, lay, 0, 1, 4, True, kernels)
        assert got["activations"] == pytest.approx(want)
    assert stage_activation_bytes(c, 128, lay, 0, 1, 4, True, "eager") > \
        stage_activation_bytes(c, 128, lay, 0, 1, 4, True, "fused")
