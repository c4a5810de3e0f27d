"""The planner (tpkit.plan): formulas against hand-computed cases, the memory model against
per-rank parameter counts worked out by hand, the Megatron papers' layouts, and clear
answers to impossible requests. Pure Python: no torch, well under a second."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from tpkit.cli import main as tpkit_main
from tpkit.plan import PlanError, Request, cost, get_hardware, papers, plan
from tpkit.plan.activations import layer_activation_bytes
from tpkit.plan.hardware import HardwareError, Link, load_profiles, profile_to_toml
from tpkit.plan.memory import Precision, model_state_bytes, params_per_rank
from tpkit.plan.planner import candidates
from tpkit.plan.simulate import Cluster, Layout, evaluate
from tpkit.plan.topology import cross_node_penalty
from tpkit.spec import theory
from tpkit.spec.config import get_preset
from tpkit.spec.shapes import layers_per_stage, stage_layer_range

LINK = Link("test", bandwidth=100e9, latency=1e-5)


# -- collectives: alpha-beta ring formulas ---------------------------------------------------
def test_all_reduce_is_2_p_minus_1_alphas_plus_2_p_minus_1_over_p_n_over_b():
    # p=4, n=1.2 GB: 2*3*10us + 2*3/4 * 1.2e9/1e11 s = 60 us + 18 ms
    assert cost.all_reduce_time(1.2e9, 4, LINK) == pytest.approx(60e-6 + 0.018)


def test_all_gather_and_reduce_scatter_are_half_an_all_reduce():
    # (p-1) alpha + (p-1)/p n/B = 30 us + 9 ms
    assert cost.all_gather_time(1.2e9, 4, LINK) == pytest.approx(30e-6 + 0.009)
    assert cost.reduce_scatter_time(1.2e9, 4, LINK) == pytest.approx(30e-6 + 0.009)


def test_a_group_of_one_sends_nothing_and_p2p_is_alpha_plus_n_over_b():
    assert cost.all_reduce_time(1e9, 1, LINK) == 0.0
    assert cost.p2p_time(1e8, LINK) == pytest.approx(1e-5 + 1e-3)


def test_group_on_intra_link_only_when_inside_a_node():
    hw = get_hardware("h100")  # 8 per node, NVLink 4 = 360 GB/s, NDR = 45 GB/s per NIC
    assert cost.link_for(8, hw).bandwidth == hw.intra.bandwidth
    assert cost.link_for(16, hw, stride=8).bandwidth == 45e9  # one rank per node: one NIC
    assert cost.link_for(16, hw).bandwidth == min(360e9, 8 * 45e9)  # 8 NICs per node


def test_devices_that_share_a_hosts_one_port_share_its_bandwidth():
    """Simulated hosts (`tpkit cluster`), or a host with one NIC: a tp group across two
    hosts of 2 ranks each gets the port, not 2 of them; the 2 dp groups that run at once,
    one rank per host each, and the 2 ranks of a stage that send at once, half each."""
    hw = replace(get_hardware("cpu"), devices_per_node=2, nics_per_node=1,
                 inter=Link("port", 1e8, 1e-4))
    assert cost.link_for(4, hw).bandwidth == pytest.approx(1e8)
    assert cost.link_for(4, hw, stride=2).bandwidth == pytest.approx(0.5e8)
    assert cost.p2p_link(4, hw).bandwidth == pytest.approx(0.5e8)
    assert cost.link_for(4, replace(hw, nics_per_node=0)).bandwidth == pytest.approx(2e8)


def test_calibrate_across_hosts_runs_under_torchrun_only(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "local.toml"
    assert tpkit_main(["calibrate", "--across", "--out", str(out)]) != 0
    assert "run `tpkit calibrate --out" in capsys.readouterr().err and not out.exists()
    out.write_text("# tpkit calibrate, by hand\n[local]\n")
    assert tpkit_main(["calibrate", "--across", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "--across runs under torchrun on two or more hosts" in err
    assert len(err.strip().splitlines()) == 1


def _ring(alpha: float, bw: float, p: int = 2) -> list:
    return [(p, n, 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw) for n in (4096, 1 << 20, 1 << 24)]


@pytest.mark.parametrize("per_host", [1, 2])
def test_calibrate_across_with_the_runs_processes_prices_both_links_as_measured(
        tmp_path, capsys, monkeypatch, per_host):
    """With P processes per host both transports are measured under the run's load (P
    groups at once): the profile takes them as they are, no descheduled-peer wait and
    no port share on top; with one per host, the inter link only, the port shared."""
    from tpkit.commands import calibrate

    out = tmp_path / "local.toml"
    hw = replace(get_hardware("cpu"), name="local", cores_per_node=2, devices_per_node=2,
                 shared_latency=5e-3)
    out.write_text(f"{calibrate.HEADER}, by test\n" + profile_to_toml(hw))
    inside = ("shm", _ring(3e-4, 1e9, per_host)) if per_host > 1 else None
    found = dict(transport="gloo", samples=_ring(8e-4, 1e8), inside=inside,
                 per_host=per_host, hosts=["a", "b"], machines=1)
    monkeypatch.setattr(calibrate, "measure_across", lambda reps: found)
    monkeypatch.setenv("WORLD_SIZE", str(2 * per_host))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_host))
    monkeypatch.setenv("RANK", "0")
    assert tpkit_main(["calibrate", "--across", "--out", str(out)]) == 0
    got = load_profiles(out)["local"]
    assert got.inter.latency == pytest.approx(8e-4) and got.inter.bandwidth == pytest.approx(1e8)
    run = Cluster(got, nodes=2, devices_per_node=2).profile
    assert run.inter.latency == pytest.approx(8e-4 if per_host > 1 else 8e-4 + 5e-3 - hw.intra.latency)
    if per_host > 1:
        assert run.intra.latency == pytest.approx(3e-4) and got.shared_latency == pytest.approx(3e-4)
        assert cost.link_for(4, run, stride=2).bandwidth == pytest.approx(1e8)  # dp across
    else:
        assert got.intra.latency == pytest.approx(hw.intra.latency)
        assert cost.link_for(4, run, stride=2).bandwidth == pytest.approx(0.5e8)


# -- compute and pipeline ---------------------------------------------------------------------
def test_gpt_layer_forward_is_24bsh2_plus_4bs2h():
    c = get_preset("gpt2-tiny")  # h=64, ffn=4h, no GQA
    b, s, h = 2, 16, 64
    f = cost.layer_forward_flops(c, b, s)
    assert f["gemm"] == 24 * b * s * h * h
    assert f["attention"] == 4 * b * s * s * h


def test_sequence_parallelism_on_a_length_tp_does_not_divide_costs_its_largest_part():
    """SP on 7 tokens at tp=2 splits them 4 + 3: the planner offers it (spec's rule, no
    divisibility), keeps the largest rank's 4 tokens and prices the padded 8 on the wire."""
    c, b = get_preset("gpt2-tiny"), 2
    assert layer_activation_bytes(c, 7, b, 2, True, "full") == 4 * b * c.hidden * 2
    assert layer_activation_bytes(c, 8, b, 2, True, "full") == 4 * b * c.hidden * 2
    assert theory.layer(b, 7, c.hidden, 2, True) == theory.layer(b, 8, c.hidden, 2, True)
    cluster = Cluster(get_hardware("h100"), nodes=1, devices_per_node=2)
    layouts, _ = candidates(Request(c, 7, 8, cluster, dict(tp=2)))
    assert {lay.sp for lay in layouts} == {False, True}


def test_bubble_is_p_minus_1_over_m_and_interleaving_divides_it_by_v():
    assert theory.bubble_theory(8, 32) == pytest.approx(7 / 32)
    assert theory.bubble_theory(8, 32, 2) == pytest.approx(7 / 64)


# -- memory: Korthikanti et al. 2022 table 2, ZeRO --------------------------------------------
def test_activations_of_gpt3_without_flash_follow_korthikanti_table_2():
    c = get_preset("gpt3-175b").with_(dropout=0.1)  # s=2048, h=12288, a=96: 5as/h = 80
    s, b = 2048, 1
    sbh = s * b * c.hidden

    def act(tp, sp, rc):  # LayerNorm statistics (fp32, 16 bytes a token) are not in the paper
        return layer_activation_bytes(c, s, b, tp, sp, rc, flash=False)

    assert act(1, False, "none") == pytest.approx(114 * sbh, rel=1e-3)
    assert act(8, False, "none") == pytest.approx(23 * sbh, rel=1e-3)
    assert act(8, True, "none") == pytest.approx(14.25 * sbh, rel=1e-3)
    assert act(8, True, "selective") == pytest.approx(4.25 * sbh, rel=1e-3)
    assert act(8, False, "full") == 2 * sbh
    assert act(8, True, "full") == 2 * sbh / 8


def test_model_state_per_sharding_stage_is_megatrons_bytes_per_parameter():
    """Megatron's distributed-optimizer guide: bf16 params + fp32 grads = 18 bytes, 6 + 12/d
    with the distributed optimizer; ZeRO-2 shards the 4 gradient bytes, FSDP the weights."""
    n, d, layer = 10**9, 8, 10**7
    prec = Precision()  # Megatron-Core's default: fp32 main gradients
    assert sum(model_state_bytes(n, d, 0, prec).values()) == 18 * n
    assert model_state_bytes(n, d, 1, prec) == {"weights": 2e9, "grads": 4e9, "optimizer": 1.5e9}
    assert model_state_bytes(n, d, 2, prec)["grads"] == 4 * n / d
    fsdp = model_state_bytes(n, d, 3, prec, layer_params=layer)
    assert fsdp["weights"] == 2 * (n / d + 2 * layer)  # own shard + 2 gathered layers
    assert fsdp["grads"] == 4 * (n / d + layer)
    bf16 = model_state_bytes(n, d, 1, Precision.for_dtype("bf16", grad="bf16"))
    assert bf16["grads"] == 2e9


def test_stage_layers_even_with_extra_on_the_first_stages():
    assert layers_per_stage(10, 4) == [3, 3, 2, 2]
    assert [list(stage_layer_range(10, 4, s)) for s in (0, 3)] == [[0, 1, 2], [8, 9]]


def test_params_per_rank_gpt2_tiny_by_hand():
    c = get_preset("gpt2-tiny")  # V=256, h=64, 4 layers, 4 heads, seq 128, biases, tied
    # one layer at tp=2: qkv 64*96+96, out 32*64+64, fc1 64*128+128, fc2 128*64+64, 2 LNs 256
    layer_tp2 = 6240 + 2112 + 16576 + 256
    assert params_per_rank(c, 2, 1, 0) == 4 * layer_tp2 + 128 * 64 + 128 * 64 + 128
    # pp=2: stage 0 embeddings, stage 1 final norm + a copy of the tied embedding shard
    assert params_per_rank(c, 2, 2, 0) == 2 * layer_tp2 + 128 * 64 + 128 * 64
    assert params_per_rank(c, 2, 2, 1) == 2 * layer_tp2 + 128 + 128 * 64
    # tp=1, pp=1 is the whole model: 4 * (12h^2 + 13h) + V h + seq h + 2h
    assert params_per_rank(c, 1, 1, 0) == 4 * (12 * 64 * 64 + 13 * 64) + 256 * 64 + 128 * 64 + 128


def test_params_per_rank_gqa_replicates_kv_heads_when_tp_exceeds_them():
    c = get_preset("llama-tiny")  # h=64, 8 heads of 8, kv=2, ffn=160, swiglu, rmsnorm, untied
    # tp=4: 2 q heads + 1 k + 1 v head per rank (kv replicated), out 16x64, MLP 3*64*40
    layer = 64 * (2 + 2) * 8 + 2 * 8 * 64 + 3 * 64 * 40 + 2 * 64
    assert params_per_rank(c, 4, 1, 0) == 4 * layer + 64 * 64 + 64 + 64 * 64


# -- the planner against the Megatron papers ---------------------------------------------------
def _published_request(p: papers.Published) -> Request:
    cluster = Cluster(get_hardware(p.hardware), nodes=p.tp * p.pp * p.dp // p.per_node,
                      flash_attention=False)
    fixed = dict(micro_batch=p.micro_batch, recompute="full", sp=False, zero=0, cp=1,
                 interleave=1)
    return Request(p.config, p.seq, p.global_batch, cluster, fixed)


@pytest.mark.parametrize("p", papers.narayanan_table1(), ids=lambda p: p.config.name)
def test_planner_keeps_tp_in_a_node_and_picks_narayanan_table1_tp(p):
    best = plan(_published_request(p))[0]
    assert best.layout.tp <= 8 and best.layout.tp == p.tp
    # the published run's own layout is predicted within 10% of the published TFLOP/s
    lay = Layout(p.tp, p.pp, p.dp, p.micro_batch, recompute="full", interleave=p.interleave)
    req = _published_request(p)
    mine = evaluate(p.config, p.seq, p.global_batch, lay, req.cluster)
    assert mine.hw_tflops_per_device == pytest.approx(p.tflops_per_gpu, rel=0.10)


@pytest.mark.parametrize("batch", [32, 128])
def test_narayanan_figure_13_peaks_at_tp8_pp8(batch):
    cluster = Cluster(get_hardware("a100-80gb"), nodes=8, flash_attention=False)
    fixed = dict(micro_batch=1, recompute="full", sp=False, zero=0, interleave=1, dp=1, cp=1)
    plans = plan(Request(papers.NARAYANAN_162B, 2048, batch, cluster, fixed))
    assert (plans[0].layout.tp, plans[0].layout.pp) == (8, 8)
    by_layout = {(e.layout.tp, e.layout.pp): e.hw_tflops_per_device for e in plans}
    worst = min(by_layout[tp_pp] for tp_pp in papers.FIG13_LAYOUTS)
    # "up to 2x" between good and bad choices; the batch-128 curve is the flatter one
    assert by_layout[(8, 8)] / worst > (1.5 if batch == 32 else 1.3)
    assert by_layout[(8, 8)] == pytest.approx(papers.NARAYANAN_FIG13_PEAK[batch], rel=0.15)
    assert "cross the node boundary" in next(e.reason for e in plans if e.layout.tp == 32)


def test_shoeybi_8_way_model_parallel_stays_in_a_dgx2h_node():
    c = papers.SHOEYBI_2019[-1]  # 8.3B
    cluster = Cluster(get_hardware("dgx2h"), nodes=32)  # 512 V100
    best = plan(Request(c, 1024, 512, cluster, dict(micro_batch=8, recompute="full")))[0]
    assert best.layout.tp * best.layout.pp <= 16  # model parallelism inside one DGX-2H


# -- impossible requests: one clear answer, not a crash -----------------------------------------
def test_model_that_fits_nowhere_names_the_numbers():
    cluster = Cluster(get_hardware("a100-40gb"), nodes=1)
    with pytest.raises(PlanError, match=r"405\.9B parameters.*8 x A100.*GB per device"):
        plan(Request(get_preset("llama3-405b"), 4096, 8, cluster))


def test_indivisible_request_names_the_numbers():
    c = get_preset("gpt2-124m")  # 12 heads
    cluster = Cluster(get_hardware("h100"), nodes=1, devices_per_node=8)
    with pytest.raises(PlanError, match="tp=8 is more than num_heads=4"):
        plan(Request(c.with_(num_heads=4), 1024, 7, cluster, {"tp": 8}))
    with pytest.raises(PlanError, match="global batch 7 is not divisible by dp="):
        plan(Request(c, 1024, 7, cluster, {"tp": 4, "pp": 1}))


def test_cli_exits_non_zero_with_the_message(capsys):
    rc = tpkit_main(["plan", "--preset", "llama3-405b", "--nodes", "1", "--hardware",
                     "a100-40gb"])
    assert rc == 2 and "tpkit plan: error: " in (err := capsys.readouterr().err) and \
        "does not fit" in err
    rc = tpkit_main(["plan", "--preset", "gpt2-124m", "--hardware", "nope"])
    assert rc == 2 and "unknown hardware 'nope'" in capsys.readouterr().err


def test_cli_json_has_the_promised_keys_best_first(capsys):
    rc = tpkit_main(["plan", "--heads", "32", "--hidden", "4096", "--layers", "32", "--vocab",
                     "32000", "--seq", "2048", "--nodes", "2", "--hardware", "h100", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0 and rows
    keys = {"tp", "pp", "dp", "micro_batch", "step_time_s", "tokens_per_s", "tflops_per_device",
            "mfu", "memory_gb", "reason"}
    assert all(keys <= set(r) for r in rows)
    times = [r["step_time_s"] for r in rows]
    assert times == sorted(times)
    assert all(r["tp"] * r["cp"] * r["pp"] * r["dp"] == 16 for r in rows)


# -- topology, profiles, no torch ---------------------------------------------------------------
def test_cross_node_penalty_is_the_alpha_difference_when_nics_match_nvlink():
    assert cross_node_penalty(None, 8, 8) is None
    text = cross_node_penalty(None, 16, 8, hardware="h100")
    # llama3-8b, b=1, s=4096: the bandwidth terms are equal (8 NDR NICs = 360 GB/s = NVLink 4),
    # so the extra is 4 all-reduces x 2(p-1) steps x (6 us - 2 us) = 0.48 ms per layer
    assert "+0.48 ms per layer" in text and f"+{0.48 * 32:.0f} ms per micro-batch" in text


def test_toml_profiles_round_trip_and_inherit(tmp_path):
    h100 = get_hardware("h100")
    path = tmp_path / "hw.toml"
    path.write_text(profile_to_toml(h100) + '\n[big]\nbase = "h100"\nmemory_gb = 96\n')
    found = load_profiles(path)
    assert found["h100"].intra.bandwidth == pytest.approx(h100.intra.bandwidth)
    assert found["h100"].accelerator.peak_flops == pytest.approx(h100.accelerator.peak_flops)
    assert found["big"].accelerator.memory_bytes == 96e9
    assert found["big"].inter == h100.inter
    assert found["h100"].intra.name == "NVLink 4"  # a measured link keeps its transport's name
    local = replace(h100, name="local", intra=replace(h100.intra, name="shm (measured)"))
    path.write_text(profile_to_toml(local))
    got = load_profiles(path)["local"]
    assert (got.intra.name, got.inter.name) == ("shm (measured)", h100.inter.name)
    path.write_text('[x]\nbase = "tpu"\n')
    with pytest.raises(HardwareError, match="not a built-in profile"):
        load_profiles(path)


def test_planner_imports_no_torch():
    code = ("import sys, pkgutil, importlib, tpkit.plan; [importlib.import_module(m.name) "
            "for m in pkgutil.walk_packages(tpkit.plan.__path__, 'tpkit.plan.')]; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_calibrate_fits_recover_known_alpha_beta_and_gemm_curve():
    from tpkit.plan.fit import fit_alpha_beta, fit_gemm

    alpha, bw = 50e-6, 2e9  # exact ring-model times for p = 2, 4 and three sizes
    samples = [(p, n, 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw)
               for p in (2, 4) for n in (4096, 1 << 20, 16 << 20)]
    assert fit_alpha_beta(samples) == pytest.approx((alpha, bw))
    peak, d_half = fit_gemm([(d, 1e11 * d / (d + 100)) for d in (16, 64, 256, 1024)])
    assert (peak, d_half) == pytest.approx((1e11, 100))


def test_calibrate_keeps_the_model_that_fits_a_link_and_the_planner_prices_by_it(tmp_path):
    from tpkit.plan.fit import fit_link

    # a link whose steps cost the longer of latency and wire time (gloo between simulated
    # hosts: the bytes travel while the peer is being woken) is fitted as such, with its
    # alpha and B; times with alpha and B added stay the ring model's
    alpha, bw, sizes = 1e-3, 60e6, [4 << (10 + 2 * i) for i in range(7)]
    over = [(2, n, 2 * max(alpha, n / 2 / bw)) for n in sizes]
    link = fit_link("gloo", over)
    assert link.overlap and (link.latency, link.bandwidth) == pytest.approx((alpha, bw))
    added = [(2, n, 2 * alpha + n / bw) for n in sizes]
    assert not fit_link("gloo", added).overlap
    # priced so: a step of a small message costs alpha whatever the bandwidth, a large
    # one its wire time; a send is one step
    assert cost.all_reduce_time(128 << 10, 4, link) == pytest.approx(6 * alpha)
    assert cost.all_reduce_time(16 << 20, 2, link) == pytest.approx((16 << 20) / bw)
    assert cost.p2p_time(16 << 10, link) == link.latency
    slow = replace(link, bandwidth=bw / 10)
    assert cost.all_reduce_time(8 << 10, 4, slow) == cost.all_reduce_time(8 << 10, 4, link)
    # kept through the profile's file, and through the links the planner derives from it
    hw = replace(get_hardware("cpu"), name="local", inter=link, devices_per_node=2)
    path = tmp_path / "local.toml"
    path.write_text(profile_to_toml(hw))
    got = load_profiles(path)["local"]
    assert got.inter.overlap and not got.intra.overlap
    assert cost.link_for(4, got).overlap and cost.p2p_link(4, replace(got, nics_per_node=1)).overlap


def test_a_steps_scalars_are_priced_by_the_latency_measured_at_their_size(tmp_path):
    """8-byte all-reduces (the loss, the gradient norm) took 0.1-0.3 ms between two
    simulated hosts where the 4 KiB ones took 1-2 ms: they are kept out of the ring's fit,
    their time per step is the link's scalar latency, and the step's closing all-reduces
    are priced by it."""
    from tpkit.plan.fit import fit_link, link_notes

    alpha, bw, scalar = 1e-3, 60e6, 75e-6
    samples = [(2, 8, 2 * scalar)] + [(2, n, 2 * max(alpha, n / 2 / bw))
                                      for n in (4 << (10 + 2 * i) for i in range(7))]
    link = fit_link("gloo", samples)
    assert (link.latency, link.bandwidth, link.scalar_latency) == pytest.approx(
        (alpha, bw, scalar))  # the 8-byte sample left the fit untouched
    assert cost.scalar_all_reduce_time(4, link) == pytest.approx(6 * scalar)
    assert "75.0 us per step for a few bytes" in link_notes(link, samples)[0]
    assert fit_link("gloo", samples[1:]).scalar_latency is None  # none measured: alpha
    assert cost.scalar_all_reduce_time(2, fit_link("gloo", samples[1:])) == pytest.approx(2 * alpha)
    hw = replace(get_hardware("cpu"), name="local", inter=link, devices_per_node=1)
    path = tmp_path / "local.toml"
    path.write_text(profile_to_toml(hw))
    got = load_profiles(path)["local"]
    assert got.inter.scalar_latency == pytest.approx(scalar) and got.intra.scalar_latency is None
    c, lay = get_preset("gpt2-tiny"), Layout(1, 2, 1, 2, recompute="none")  # pp across nodes
    sync = [evaluate(c, 64, 8, lay, Cluster(h, nodes=2)).terms["step_sync"]
            for h in (got, replace(got, inter=replace(got.inter, scalar_latency=None)))]
    assert sync[1] - sync[0] == pytest.approx(2 * 2 * (alpha - scalar))  # loss and norm
    # processes sharing cores: a scalar's step waits for the descheduled peer as any does
    shared = replace(got, intra=replace(got.intra, scalar_latency=1e-6), cores_per_node=1,
                     shared_latency=got.intra.latency + 5e-4)
    prof = Cluster(shared, nodes=2, devices_per_node=2).profile
    assert prof.intra.scalar_latency is None
    assert prof.inter.scalar_latency == pytest.approx(scalar + 5e-4)


# -- the local CPU profile: dispatch overhead and processes sharing cores ------------------------
def _cpu(op_overhead: float = 0.0, cores: int = 0, shared: float = 0.0):
    from dataclasses import replace

    hw = get_hardware("cpu")
    return replace(hw, accelerator=replace(hw.accelerator, op_overhead=op_overhead),
                   cores_per_node=cores, shared_latency=shared)


def test_dispatch_overhead_is_ops_per_layer_micro_batch_and_parameter_tensor():
    # gpt2-tiny, tp=pp=dp=1, m=4: 4 (85 + 102*4) + 18 (12*4 + 4) ops of 1 us each
    c, lay = get_preset("gpt2-tiny"), Layout(1, 1, 1, 2, recompute="none")
    assert cost.param_tensors_per_layer(c) == 12  # 2 layer norms + 4 linears, with biases
    slow = evaluate(c, 128, 8, lay, Cluster(_cpu(1e-6), 1, 1)).step_time_s
    fast = evaluate(c, 128, 8, lay, Cluster(_cpu(0.0), 1, 1)).step_time_s
    assert slow - fast == pytest.approx((4 * (85 + 102 * 4) + 18 * (12 * 4 + 4)) * 1e-6)


def test_more_processes_than_cores_share_them_and_wait_longer_for_peers():
    hw = _cpu(3e-6, cores=2, shared=1e-3)
    own, shared = Cluster(hw, 1, 2).profile, Cluster(hw, 1, 4).profile
    assert own.accelerator == hw.accelerator and own.intra == hw.intra
    assert shared.accelerator.peak_flops == hw.accelerator.peak_flops / 2
    assert shared.accelerator.op_overhead == pytest.approx(6e-6)
    assert shared.intra.latency == 1e-3
    # hosts that share the machine's cores (`tpkit cluster`): the same wait for a peer that
    # is not running comes on top of the network's latency between them
    across = Cluster(hw, 2, 4).profile.inter
    assert across.latency == pytest.approx(hw.inter.latency + 1e-3 - hw.intra.latency)
    assert Cluster(hw, 2, 2).profile.inter == hw.inter
    text = profile_to_toml(hw)
    assert "cores_per_node = 2" in text and "shared_latency_us = 1000" in text


def test_local_plan_prefers_data_parallel_when_collectives_cost_a_millisecond(tmp_path):
    path = tmp_path / "local.toml"
    hw = _cpu(3.5e-6, cores=2, shared=1e-3)
    path.write_text(profile_to_toml(hw).replace("[cpu]", "[local]").replace(
        "intra_latency_us = 50", "intra_latency_us = 900"))
    best = plan(Request(get_preset("gpt2-tiny"), 128, 8,
                        Cluster(get_hardware("local", path), 1, 4)))[0]
    assert (best.layout.tp, best.layout.pp, best.layout.dp) == (1, 1, 4)


def test_calibrate_says_where_it_writes_and_keeps_a_file_it_did_not_write(tmp_path, capsys):
    mine = tmp_path / "local.toml"
    mine.write_text("[local]\nmy = 1\n")  # the user's own file at that path
    rc = tpkit_main(["calibrate", "--out", str(mine)])
    err = capsys.readouterr().err
    assert rc != 0 and mine.read_text() == "[local]\nmy = 1\n"  # untouched, nothing measured
    assert f"--out {mine} exists and was not written by `tpkit calibrate`" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow  # two 2-process spawns
def test_calibrate_measures_the_transport_inside_a_host_and_gloo_across():
    """The intra link is timed over what `tpkit train` uses between the ranks of a host
    (shared memory where its kernels load), the inter link over gloo: not both over gloo."""
    from tpkit.check.measure import measure_all_reduce
    from tpkit.comm.shm_build import load

    inside, samples = measure_all_reduce(2, (4096,), reps=1)
    across, _ = measure_all_reduce(2, (4096,), reps=1, comm="gloo")
    assert inside == ("shm" if load() is not None else "gloo") and across == "gloo"
    assert [(p, n) for p, n, _ in samples] == [(2, 4096)]
