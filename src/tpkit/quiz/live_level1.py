"""Level 1's live demonstrations: the seed quiz's eight answers, each run for real.

Megatron's notation throughout: X the input, A = [A1 | A2] split by columns,
Y = GeLU(XA) = [Y1 | Y2], B = [B1 ; B2] split by rows, Z = YB = Y1B1 + Y2B2.
Each function returns its figures, `text` (from `live_text.json`) and `charts`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tpkit.comm.group import CommGroup
from tpkit.layers import ColumnColumnMLP, ParallelMLP, RowParallelLinear
from tpkit.layers.attention import ParallelAttention
from tpkit.plan import cost
from tpkit.plan.hardware import PROFILES
from tpkit.plan.memory import Precision
from tpkit.plan.simulate import Layout, tp_collectives
from tpkit.quiz import live_charts as C
from tpkit.quiz import live_ranks as R
from tpkit.quiz.live_common import (
    Spawner,
    max_diff,
    median_of_slowest,
    start_and_each,
    x_input,
)
from tpkit.quiz.live_text import Say
from tpkit.spec.config import PRESETS, ModelConfig
from tpkit.spec.grid import rank_grid
from tpkit.spec.shapes import kv_heads_per_rank
from tpkit.spec.theory import ring_steps


def _weights_chart(say: Say, hidden: int, ffn: int, tp: int) -> dict:
    return C.matrices(say("chart"), [C.matrix("A", [hidden, ffn], "cols", tp),
                                     C.matrix("B", [ffn, hidden], "rows", tp)])


def demo_split(live: Spawner, tp: int = 2, hidden: int = 16, ffn: int = 64,
               lang: str = "en") -> dict:
    """Answer 1: the weight matrices of one layer, split; together they are the tp=1 weights."""
    ranks = live.spawn(R.mlp_weights, hidden, ffn, tp=tp)
    ref = ParallelMLP(hidden, ffn, CommGroup.single())
    fc1 = torch.cat([r["fc1"] for r in ranks], dim=0)  # columns of A = rows of torch's [out, in]
    fc2 = torch.cat([r["fc2"] for r in ranks], dim=1)
    out = dict(tp=tp, full_fc1=list(ref.fc1.weight.shape), full_fc2=list(ref.fc2.weight.shape),
               per_rank=[dict(rank=i, fc1=list(r["fc1"].shape), fc2=list(r["fc2"].shape))
                         for i, r in enumerate(ranks)],
               max_abs_diff=max(max_diff(fc1, ref.fc1.weight), max_diff(fc2, ref.fc2.weight)))
    say = Say(lang, "split")
    lines = [say("head", hidden=hidden, ffn=ffn, tp=tp),
             say("full", fc1=out["full_fc1"], fc2=out["full_fc2"])]
    lines += [say("rank", **p) for p in out["per_rank"]]
    lines.append(say("diff", diff=out["max_abs_diff"]))
    return dict(out, text="\n".join(lines), charts=[_weights_chart(say, hidden, ffn, tp)])


def demo_mlp_traffic(live: Spawner, tp: int = 2, b: int = 2, s: int = 4, hidden: int = 16,
                     ffn: int = 64, lang: str = "en") -> dict:
    """Answer 2: column->row sends one all-reduce forward (g) and one backward (f);
    column->column needs all-gathers."""
    x = x_input(b, s, hidden)
    rank0 = live.spawn(R.mlp_traffic, x, hidden, ffn, tp=tp)[0]
    ref = ParallelMLP(hidden, ffn, CommGroup.single())(x)
    ref_cc = ColumnColumnMLP(hidden, ffn, CommGroup.single())(x)
    out, say = dict(tp=tp), Say(lang, "mlp_traffic")
    lines = [say("head", hidden=hidden, ffn=ffn, b=b, s=s, tp=tp)]
    width = max(len(say(name)) for name in ("column_row", "column_column"))
    for name, y_ref in (("column_row", ref), ("column_column", ref_cc)):
        recs = rank0[name]["records"]
        out[name] = dict(records=recs, wire_bytes=sum(r[3] for r in recs),
                         max_abs_diff=max_diff(rank0[name]["y"], y_ref.detach()))
        lines.append(say("layout", layout=say(name).ljust(width), records=say.records(recs)))
        lines.append(say("sent", bytes=out[name]["wire_bytes"], diff=out[name]["max_abs_diff"]))
    sent = C.bars(say("chart_bytes", tp=tp), "B", [
        C.bar(say(name), out[name]["wire_bytes"], f"{out[name]['wire_bytes']:.0f} B",
              0 if name == "column_row" else "comm") for name in ("column_row", "column_column")])
    charts = [_weights_chart(Say(lang, "split"), hidden, ffn, tp), sent]
    return dict(out, text="\n".join(lines), charts=charts)


def demo_node(live: Spawner, tp: int = 2, model: str = "gpt3-175b", hardware: str = "h100",
              seq: int = 2048, b: int = 1, lang: str = "en") -> dict:
    """Answer 3: the planner's per-layer tp traffic inside a node vs across, and a local run."""
    plan = planner_layer(tp, model, hardware, seq, b)
    times = median_of_slowest(live.spawn(R.all_reduce_times, b * 128 * 256, (4,), tp=tp))
    out = dict(tp=tp, planner=plan, local_layer_s=times[4], local_numel=b * 128 * 256)
    say = Say(lang, "node")
    lines = [say("head"), say("planner", model=model, b=b, seq=seq, tp=tp, hardware=hardware),
             say("compute", ms=plan["compute_s"] * 1e3),
             say("intra", ms=plan["intra_s"] * 1e3, link=plan["intra_link"]),
             say("inter", ms=plan["inter_s"] * 1e3, link=plan["inter_link"],
                 ratio=plan["inter_s"] / plan["intra_s"]),
             say("measured", b=b, tp=tp, ms=times[4] * 1e3)]
    out["hosts_s"], said = node_across_hosts(live, say, b * 128 * 256, times[4] if tp == 2 else None)
    lines += said
    ms = [("compute_bar", plan["compute_s"], 0), ("intra_bar", plan["intra_s"], 2),
          ("inter_bar", plan["inter_s"], "comm")]
    bars = C.bars(say("chart_times", model=model, tp=tp), "ms", [
        C.bar(say(k, link=plan["intra_link" if k == "intra_bar" else "inter_link"]), v * 1e3,
              f"{v * 1e3:.2f} ms", c) for k, v, c in ms])
    return dict(out, text="\n".join(lines), charts=[bars, placement_grid(say, tp)])


FLAT = 1.25  # slower link / faster link below this: the link's speed barely shows


def node_across_hosts(live: Spawner, say: Say, numel: int, inside: float | None
                      ) -> tuple[dict[str, float], list[str]]:
    """Answer 3 measured across two simulated hosts at each link speed (`live.across`):
    {link: seconds of 4 all-reduces of `numel` floats}, and the lines saying it against
    `inside` (the same at tp=2 on one host; None: not measured at tp=2); or the lines
    saying why hosts could not be made and what would change."""
    found = live.across()
    if isinstance(found, str) or numel not in next(iter(found.values()), {}):
        return {}, [say("no_hosts", why=found if isinstance(found, str) else
                        f"measured for other sizes than {numel} floats")]
    secs = {link: median_of_slowest(jobs[numel])[4] for link, jobs in found.items()}
    lines = [say("hosts_head")]
    lines += [say("hosts", link=link, ms=t * 1e3) +
              (say("hosts_ratio", ratio=t / inside) if inside else "") for link, t in secs.items()]
    if max(secs.values()) < FLAT * min(secs.values()):
        lines.append(say("hosts_flat", kib=numel * 4 // 1024))
    return secs, lines


def placement_grid(say: Say, tp: int) -> dict:
    """2 nodes of 8 GPUs: one tp group (blue) inside node 0, or spread over both nodes."""
    return C.grid(say("chart_grid", tp=tp), [
        C.row(say("inside"), [C.cell(str(r), 0 if r < tp else "muted") for r in range(16)]),
        C.row(say("across"), [C.cell(str(r), 0 if r % (16 // tp) == 0 else "muted")
                              for r in range(16)])], per_node=8, node=say("node"))


def planner_layer(tp: int, model: str, hardware: str, seq: int, b: int) -> dict:
    """The planner's compute and tp all-reduce times of one layer, inside a node and
    across nodes (the same group with one GPU per node)."""
    c, hw = PRESETS[model], PROFILES[hardware]
    n = b * seq * c.hidden * 2  # bytes of one bf16 activation [b, s, h]
    flops = cost.layer_forward_flops(c, b, seq)
    compute = 3 * (cost.gemm_time(flops["gemm"] / tp, hw.accelerator, min(b * seq, c.hidden / tp))
                   + cost.gemm_time(flops["attention"] / tp, hw.accelerator, c.head_dim))
    one_per_node = replace(hw, devices_per_node=1)  # the same group, one GPU per node
    lay, prec = Layout(tp, 1, 1, b, recompute="none"), Precision()  # 4 all-reduces a layer
    return dict(compute_s=compute, bytes=n, intra_link=hw.intra.name, inter_link=hw.inter.name,
                intra_s=sum(tp_collectives(c, seq, lay, hw, prec).values()),
                inter_s=sum(tp_collectives(c, seq, lay, one_per_node, prec).values()),
                layers=c.num_layers, inter_alpha=hw.inter.latency, intra_alpha=hw.intra.latency)


def demo_heads(live: Spawner, tp: int = 2, hidden: int = 64, num_heads: int = 8,
               num_kv_heads: int = 2, lang: str = "en") -> dict:
    """Answer 4: which query and kv heads each rank owns, and its real qkv weight shape."""
    x = x_input(2, 4, hidden)
    ranks = live.spawn(R.attention_heads, x, hidden, num_heads, num_kv_heads, tp=tp)

    ref = ParallelAttention(ModelConfig(hidden=hidden, num_heads=num_heads,
                                        kv_heads=num_kv_heads), CommGroup.single())
    with torch.no_grad():
        y_ref = ref(x)
    say = Say(lang, "heads")
    kv_note = (say("kv_split", n=kv_heads_per_rank(num_heads, num_kv_heads, tp)) if num_kv_heads >= tp
               else say("kv_shared", n=tp // num_kv_heads))
    arithmetic = [heads_arithmetic(num_heads, num_kv_heads, tp, i) for i in range(tp)]
    out = dict(tp=tp, heads_per_rank=num_heads // tp, arithmetic=arithmetic, per_rank=[
        dict(rank=i, q_heads=r["q"], kv_heads=r["kv"], qkv_weight=r["qkv"], out_weight=r["out"])
        for i, r in enumerate(ranks)], max_abs_diff=max(max_diff(r["y"], y_ref) for r in ranks))
    out["layer_matches_arithmetic"] = [[p["q_heads"], p["kv_heads"]] for p in out["per_rank"]] \
        == arithmetic
    lines = [say("head", hidden=hidden, heads=num_heads, kv=num_kv_heads, tp=tp,
                 per_rank=num_heads // tp, kv_note=kv_note)]
    lines += [say("rank", rank=p["rank"], q=p["q_heads"], kv=p["kv_heads"], qkv=p["qkv_weight"],
                  out=p["out_weight"]) for p in out["per_rank"]]
    lines += [say("match", ok=say.yes_no(out["layer_matches_arithmetic"])),
              say("diff", diff=out["max_abs_diff"])]
    return dict(out, text="\n".join(lines), charts=[heads_chart(say, out["per_rank"], tp)])


def heads_chart(say: Say, per_rank: list[dict], tp: int) -> dict:
    """Query heads and kv heads, each coloured by the rank that holds it."""
    q = [C.cell(f"q{h}", p["rank"]) for p in per_rank for h in p["q_heads"]]
    kv = [C.cell(f"kv{h}", p["rank"]) for p in per_rank for h in p["kv_heads"]]
    return C.grid(say("chart", tp=tp), [C.row(say("q_row"), q), C.row(say("kv_row"), kv)],
                  per_node=0, node="")


def heads_arithmetic(heads: int, kv: int, tp: int, r: int) -> list[list[int]]:
    """[query heads, kv heads] of rank r: nh/tp consecutive heads; kv split or shared."""
    q = list(range(r * heads // tp, (r + 1) * heads // tp))
    if kv >= tp:
        return [q, list(range(r * kv // tp, (r + 1) * kv // tp))]
    return [q, [q[0] * kv // heads]]  # the kv head its query heads read


def demo_all_reduce(live: Spawner, tp: int = 2, b: int = 2, s: int = 4, hidden: int = 16,
                    ffn: int = 64, lang: str = "en") -> dict:
    """Answer 5: each rank's partial MLP output; the all-reduce makes them the tp=1 output."""
    x = x_input(b, s, hidden)
    ranks = live.spawn(R.mlp_partials, x, hidden, ffn, tp=tp)
    with torch.no_grad():
        y_ref = ParallelMLP(hidden, ffn, CommGroup.single())(x)
    summed = sum(r["partial"] for r in ranks)
    out = dict(tp=tp, partial_vs_ref=[max_diff(r["partial"], y_ref) for r in ranks],
               records=ranks[0]["records"], sum_vs_ref=max_diff(summed, y_ref),
               all_reduced_vs_ref=max(max_diff(r["y"], y_ref) for r in ranks),
               first=[[round(float(v), 4) for v in r["partial"][0, 0, :3]] for r in ranks],
               ref_first=[round(float(v), 4) for v in y_ref[0, 0, :3]])
    say = Say(lang, "all_reduce")
    lines = [say("head", tp=tp, b=b, s=s, hidden=hidden)]
    lines += [say("rank", rank=i, first=f, diff=d)
              for i, (f, d) in enumerate(zip(out["first"], out["partial_vs_ref"]))]
    lines += [say("sum", values=[round(float(v), 4) for v in summed[0, 0, :3]]),
              say("ref", values=out["ref_first"]),
              say("ledger", records=say.records(out["records"])),
              say("diff", diff=out["all_reduced_vs_ref"])]
    chart = C.sums(say("chart", tp=tp),
                   [C.term(say("term", rank=i), r["partial"][0, 0, :4], i)
                    for i, r in enumerate(ranks)],
                   C.term(say("total"), summed[0, 0, :4], "ok"),
                   C.term(say("check"), y_ref[0, 0, :4], "ref"))
    return dict(out, text="\n".join(lines), charts=[chart])


def demo_grid(live: Spawner, tp: int = 2, pp: int = 2, dp: int = 1, lang: str = "en") -> dict:
    """Answer 6: the rank grid of a (tp, pp, dp) mesh, read back from every spawned rank,
    drawn with nodes of tp GPUs: tp groups inside a node, pipeline stages across."""
    ranks = live.spawn(R.mesh_coords, tp=tp, pp=pp, dp=dp)
    out = dict(tp=tp, pp=pp, dp=dp, world=tp * pp * dp, grid=rank_grid(tp, pp, dp),
               ranks_per_node=ranks[0]["per_node"], ranks=ranks)
    say = Say(lang, "grid")
    lines = [say("head", world=out["world"], tp=tp, pp=pp, dp=dp, per_node=out["ranks_per_node"])]
    lines += [say("row", d=d, stages="  ".join(f"pp{p}:{g}" for p, g in enumerate(stages)))
              for d, stages in enumerate(out["grid"])]
    lines += [say("rank", rank=r["rank"], dp=r["coord"][0], pp=r["coord"][1], tp=r["coord"][2],
                  tp_group=r["tp"], pp_group=r["pp"], dp_group=r["dp"]) for r in ranks]
    rows = [C.row(f"dp{d}", [C.cell(str(r["rank"]), r["coord"][1])
                             for r in ranks if r["coord"][0] == d]) for d in range(dp)]
    chart = C.grid(say("chart", tp=tp, pp=pp, dp=dp), rows, per_node=tp, node=say("node"))
    return dict(out, text="\n".join(lines), charts=[chart])


def demo_partial_sums(live: Spawner, tp: int = 2, b: int = 2, s: int = 4, hidden: int = 16,
                      ffn: int = 64, lang: str = "en") -> dict:
    """Answer 7: B split by rows; each rank's Y_r B_r is partial, their sum is Z = YB."""
    y = x_input(b, s, ffn, seed=1)  # Y, the input of the second matrix: [b, s, ffn]
    ranks = live.spawn(R.row_partials, y, ffn, hidden, tp=tp)
    with torch.no_grad():
        ref = RowParallelLinear(ffn, hidden, CommGroup.single(), input_is_parallel=False)
        z_ref = ref(y)  # [b, s, h]
    total = sum(r["partial"] for r in ranks) + ref.bias.detach()
    out = dict(tp=tp, weight_per_rank=[r["weight"] for r in ranks],
               partial_shape=list(ranks[0]["partial"].shape),
               partial_vs_ref=[max_diff(r["partial"], z_ref) for r in ranks],
               sum_vs_ref=max_diff(total, z_ref))
    say = Say(lang, "partial_sums")
    lines = [say("head", ffn=ffn, hidden=hidden, tp=tp, shape=out["weight_per_rank"][0])]
    lines += [say("rank", rank=i, i=i + 1, shape=out["partial_shape"], diff=d)
              for i, d in enumerate(out["partial_vs_ref"])]
    lines.append(say("sum", tp=tp, diff=out["sum_vs_ref"]))
    chart = C.sums(say("chart", tp=tp),
                   [C.term(f"Y{i + 1}B{i + 1}", r["partial"][0, 0, :4], i)
                    for i, r in enumerate(ranks)],
                   C.term("Z", total[0, 0, :4], "ok"), C.term(say("check"), z_ref[0, 0, :4], "ref"))
    return dict(out, text="\n".join(lines), charts=[chart])


def demo_latency(live: Spawner, tp: int = 2, counts: tuple[int, ...] = (1, 2, 4, 8),
                 numel: int = 256, model: str = "gpt3-175b", hardware: str = "h100",
                 lang: str = "en") -> dict:
    """Answer 8: k small all-reduces in sequence cost about k times one (medians over warm
    repeats), and the planner's latency per step inside a node vs across nodes."""
    ranks = live.spawn(R.all_reduce_times, numel, counts, tp=tp)
    measured = median_of_slowest(ranks)
    one = measured[counts[0]] / counts[0]
    plan = planner_layer(tp, model, hardware, 2048, 1)
    n_coll = 4 * plan["layers"]
    alpha = [n_coll * ring_steps("all_reduce", tp) * a for a in (plan["intra_alpha"], plan["inter_alpha"])]
    out = dict(tp=tp, counts=list(counts), measured_s=[measured[n] for n in counts],
               ratio_to_one=[measured[n] / one for n in counts], planner=plan,
               ledger_all_reduces=[r["ledger"] for r in ranks],
               collectives_per_step=n_coll, latency_intra_s=alpha[0], latency_inter_s=alpha[1])
    say = Say(lang, "latency")
    lines = [say("head", numel=numel, tp=tp)]
    lines += [say("count", n=n, ms=measured[n] * 1e3, ratio=measured[n] / one, theory=n)
              for n in counts]
    out["start_s"], out["each_s"] = start_and_each(measured)
    lines += accumulation(say, counts, measured, out["start_s"], out["each_s"], n_coll)
    if ranks[0]["tcp_times"]:  # the ranks share memory: also measured over loopback TCP
        k = counts[-1]
        out["tcp_one_s"] = median_of_slowest(ranks, "tcp_times")[k] / k
        lines.append(say("links", us_shm=one * 1e6, us_tcp=out["tcp_one_s"] * 1e6,
                         ratio=out["tcp_one_s"] / one))
    out["hosts"], said = latency_across_hosts(live, say, numel, counts, n_coll)
    lines += said
    lines += [say("planner", model=model, n_coll=n_coll, layers=plan["layers"], tp=tp),
              say("alpha", intra=alpha[0] * 1e3, inter=alpha[1] * 1e3,
                  intra_total=plan["intra_s"] * plan["layers"] * 1e3,
                  inter_total=plan["inter_s"] * plan["layers"] * 1e3)]
    seq = C.bars(say("chart_measured", numel=numel, tp=tp), "ms", [
        C.bar(f"k = {n}", measured[n] * 1e3, f"{measured[n] * 1e3:.2f} ms", 0, ref=n * one * 1e3)
        for n in counts], ref_label=say("theory"))
    step = C.bars(say("chart_planner", model=model, tp=tp, n_coll=n_coll), "ms", [
        C.bar(say("intra"), alpha[0] * 1e3, f"{alpha[0] * 1e3:.2f} ms", 2),
        C.bar(say("inter"), alpha[1] * 1e3, f"{alpha[1] * 1e3:.2f} ms", "comm")])
    return dict(out, text="\n".join(lines),
                charts=[seq, step, placement_grid(Say(lang, "node"), tp)])


def latency_across_hosts(live: Spawner, say: Say, numel: int, counts: tuple[int, ...],
                         n_coll: int) -> tuple[dict, list[str]]:
    """Answer 8's sequences timed across two simulated hosts per link: the cost each
    all-reduce adds there and what `n_coll` of them accumulate; or why not measured."""
    found = live.across()
    if isinstance(found, str) or any(numel not in jobs for jobs in found.values()):
        return {}, [say("no_hosts", why=found if isinstance(found, str) else
                        f"measured for other sizes than {numel} floats")]
    out, lines = {}, []
    for link, jobs in found.items():
        measured = median_of_slowest(jobs[numel])
        if list(measured) != list(counts):
            continue
        start, each = start_and_each(measured)
        out[link] = dict(one_s=measured[counts[0]] / counts[0], start_s=start, each_s=each)
        lines.append(say("hosts", link=link, one_us=out[link]["one_s"] * 1e6,
                         each_us=each * 1e6, n_coll=n_coll, total_ms=n_coll * each * 1e3))
    return out, lines


DIFFERS = 0.15  # measured k-sequence vs k x one: beyond this relative gap, say why


def accumulation(say: Say, counts: tuple[int, ...], measured: dict[int, float], start: float,
                 each: float, n_coll: int) -> list[str]:
    """Answer 8's arithmetic beside its measurement: the line start + k x each through
    the sequences; why k collectives cost less than k x one when they do (the start is
    paid once); what accumulates over the collectives of a step (each, not one)."""
    k, one = counts[-1], measured[counts[0]] / counts[0]
    ratio = measured[k] / one
    lines = [say("fit", start_us=start * 1e6, each_us=each * 1e6, k=k,
                 fit_us=(start + k * each) * 1e6, got_us=measured[k] * 1e6)]
    lines.append(say("differs", one_us=one * 1e6, start_us=start * 1e6, each_us=each * 1e6,
                     k=k, ratio=ratio) if abs(ratio - k) > DIFFERS * k else say("agrees"))
    lines.append(say("accumulate", n_coll=n_coll, each_us=each * 1e6,
                     total_ms=n_coll * each * 1e3))
    return lines


DEMOS = {1: demo_split, 2: demo_mlp_traffic, 3: demo_node, 4: demo_heads,
         5: demo_all_reduce, 6: demo_grid, 7: demo_partial_sums, 8: demo_latency}
