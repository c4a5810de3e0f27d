"""The planner on modern runs: flash attention, fp32 main gradients, data-parallel
sharding (ZeRO-1/2, FSDP), context parallelism, and a command line that runs.
Pure Python apart from argparse: well under a few seconds."""

from __future__ import annotations

import argparse
import shlex

import pytest

from tpkit.cli import main as tpkit_main
from tpkit.plan import PlanError, Request, get_hardware, plan
from tpkit.plan.activations import layer_activation_bytes
from tpkit.plan.memory import Precision, layout_stage_layers, params_per_rank
from tpkit.plan.reasons import gb
from tpkit.plan.simulate import Cluster, Layout, evaluate
from tpkit.plan.tables import COLUMNS
from tpkit.spec.config import get_preset

# Llama 3 paper (Dubey et al. 2024), table 4: 405B on 8,192 H100, TP 8, CP 1, PP 16, DP 64,
# sequence 8192, 16M tokens per batch (2048 sequences), FSDP, no activation checkpointing.
LLAMA3_405B = dict(tp=8, cp=1, pp=16, dp=64, micro_batch=1, sp=True, recompute="none",
                   zero=3, interleave=1, lighter_ends=True)


def _llama3_405b(flash: bool = True, **changes) -> Request:
    cluster = Cluster(get_hardware("h100"), nodes=1024, flash_attention=flash)
    return Request(get_preset("llama3-405b"), 8192, 2048, cluster, {**LLAMA3_405B, **changes})


def test_published_405b_layout_fits_with_flash_attention_and_no_recompute():
    best = plan(_llama3_405b())[0]
    card = get_hardware("h100").accelerator.memory_bytes
    assert card == 81559 * 2**20  # nvidia-smi's memory.total of an "80 GB" H100: 80 GiB less a little
    assert best.memory["total"] < 0.9 * card  # the usable share
    assert best.memory["activations"] > 0.8 * best.memory["total"]  # 16 micro-batches in flight
    assert "FSDP" in best.reason and f"of {card / 1e9:.0f} GB" in best.reason
    assert layout_stage_layers(126, best.layout) == [7] + [8] * 14 + [7]  # as the paper did
    # the scores term alone (a s^2 b per layer) would need hundreds of GB: rejected
    with pytest.raises(PlanError, match="does not fit"):
        plan(_llama3_405b(flash=False))


def test_flash_attention_memory_is_the_same_whatever_the_recompute_mode():
    c, cluster = get_preset("llama3-70b"), Cluster(get_hardware("h100"), nodes=8)
    mems = [evaluate(c, 8192, 64, Layout(8, 4, 2, 1, sp=True, recompute=rc), cluster)
            .memory["activations"] for rc in ("none", "selective")]
    assert mems[0] == mems[1]


def test_gradients_are_fp32_by_default_and_bf16_on_request():
    c, cluster = get_preset("llama3-70b"), Cluster(get_hardware("h100"), nodes=8)
    lay = Layout(8, 4, 2, 1, sp=True, zero=1)
    fp32 = evaluate(c, 4096, 512, lay, cluster)  # Megatron-Core's default
    bf16 = evaluate(c, 4096, 512, lay, cluster, Precision.for_dtype("bf16", grad="bf16"))
    first = params_per_rank(c, 8, 4, 0)  # the fullest stage: embedding + 4 in-flight batches
    assert fp32.memory["grads"] == 4 * first and bf16.memory["grads"] == 2 * first
    assert fp32.terms["dp"] >= bf16.terms["dp"]  # fp32 gradients reduce twice the bytes


def test_sharding_stages_trade_memory_for_traffic():
    c, cluster = get_preset("llama3-8b"), Cluster(get_hardware("h100"), nodes=4)
    runs = [evaluate(c, 4096, 256, Layout(1, 1, 32, 1, zero=z), cluster) for z in range(4)]
    opt, grads, weights = ([r.memory[k] for r in runs] for k in ("optimizer", "grads",
                                                                 "weights"))
    assert opt[0] > opt[1] == opt[2] == opt[3]  # ZeRO-1 shards the optimizer state
    assert grads[1] > grads[2]  # ZeRO-2 the gradients
    assert weights[2] > weights[3]  # FSDP the weights
    no_overlap = Cluster(get_hardware("h100"), nodes=4, overlap_dp=False)
    dp = [evaluate(c, 4096, 256, Layout(1, 1, 32, 1, zero=z), no_overlap).terms["dp"]
          for z in range(4)]
    assert dp[3] > dp[2] > dp[1]  # per-micro-batch gathers and reduce-scatters cost more


def test_context_parallelism_plans_a_128k_sequence():
    """llama3-70b at 131,072 tokens on 64 H100: without cp only full recomputation fits (one
    sequence's activations on every tp group); cp splits the sequence over a ring and runs
    faster without recomputing anything."""
    c = get_preset("llama3-70b").with_(max_seq_len=131072)
    cluster = Cluster(get_hardware("h100"), nodes=8)
    flat = plan(Request(c, 131072, 16, cluster, {"cp": 1, "tp": 8}))
    assert all(e.layout.recompute == "full" for e in flat)
    ring = plan(Request(c, 131072, 16, cluster, {"tp": 8}))
    assert ring[0].layout.cp > 1 and ring[0].layout.recompute == "none"
    assert ring[0].step_time_s < flat[0].step_time_s
    assert "ring of" in ring[0].reason
    pinned = plan(Request(c, 131072, 16, cluster, {"cp": 4, "tp": 8}))
    assert all(e.layout.cp == 4 for e in pinned)
    one, eight = (layer_activation_bytes(c, 131072, 1, 8, True, cp=k) for k in (1, 8))
    assert one == pytest.approx(8 * eight)  # activations / cp


def test_memory_in_gb_keeps_digits_for_small_models():
    assert (gb(71.4e9), gb(3.41e9), gb(0.0123e9), gb(8.1e6)) == (
        "71 GB", "3.4 GB", "0.012 GB", "0.0081 GB")


def _printed(capsys, argv: list[str]) -> str:
    assert tpkit_main(argv) == 0
    return capsys.readouterr().out


def test_plan_prints_a_tpkit_command_that_the_train_parser_accepts(capsys):
    from tpkit.commands.train import add_arguments, config_from_args

    out = _printed(capsys, ["plan", "--preset", "llama3-70b", "--nodes", "8", "--hardware",
                            "h100"])
    line = next(x for x in out.splitlines() if "-m tpkit train" in x)
    assert line.strip().startswith("torchrun --nnodes 8 --nproc_per_node 8")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(shlex.split(line.split(" train ", 1)[1])), 64)
    cfg.check(64)  # every flag known, the layout valid for 64 processes
    assert cfg.preset == "llama3-70b" and cfg.global_batch == 512
    assert any("--tensor-model-parallel-size" in x for x in out.splitlines())
    for column in COLUMNS:  # every heading explained under the table
        assert f" {column}  " in out


def test_help_explains_every_column(capsys):
    with pytest.raises(SystemExit):
        tpkit_main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for meaning in COLUMNS.values():
        assert " ".join(meaning.split()) in text
