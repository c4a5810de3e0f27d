"""Live demonstrations: each quiz answer proved by a real run of the library on CPU processes.

    with LiveSession() as live:
        figures = live.run(2, tp=4)      # dict of computed figures, and figures["text"]
        live.text(2, lang="fr")          # the same demonstration, told in French

One function per answer (`DEMOS[n]`); each spawns gloo ranks (processes are kept in
a pool per world size and reused), runs the real layers, collectives and ledger, and
returns what it measured. Nothing is canned: change tp and the figures change.
The per-rank functions live in `live_ranks` (module level, so they pickle); the words
come from `live_text.json` (one template set per language, via `live_text.Say`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpkit.comm.group import CommGroup
from tpkit.layers import ColumnColumnMLP, ParallelMLP, RowParallelLinear
from tpkit.quiz import live_ranks as R
from tpkit.quiz.live_text import Say
from tpkit.spec.grid import rank_grid
from tpkit.spec.shapes import kv_heads_per_rank
from tpkit.spec.theory import ring_steps

Runner = Callable[..., list]  # runner(fn, world, *args, mesh=dict(tp=, pp=, dp=)) -> per rank
SHAPE = dict(b=2, s=4, hidden=16, ffn=64)


class LiveSession:
    """Worker pools (one per world size) shared by all demonstrations of a sitting."""

    def __init__(self, runner: Runner | None = None, timeout: float = 120.0) -> None:
        self._runner, self._pools, self.timeout = runner, {}, timeout

    def spawn(self, fn: Callable, *args, tp: int, pp: int = 1, dp: int = 1) -> list:
        """Run `fn(mesh, *args)` on tp*pp*dp ranks; per-rank results in rank order."""
        mesh, world = dict(tp=tp, pp=pp, dp=dp), tp * pp * dp
        if self._runner is not None:
            return self._runner(fn, world, *args, mesh=mesh)
        if world not in self._pools:
            from tpkit.launch import WorkerPool

            self._pools[world] = WorkerPool(world, timeout=self.timeout, threads=1)
        return self._pools[world].run(fn, *args, mesh=mesh)

    def run(self, number: int, tp: int = 2, lang: str = "en") -> dict:
        """Demonstration `number` (1..8) at tensor-parallel size `tp`, told in `lang`."""
        if number not in DEMOS:
            raise ValueError(f"no demonstration {number}; they are numbered 1 to 8")
        return DEMOS[number](self, tp=tp, lang=lang)

    def text(self, number: int, tp: int = 2, lang: str = "en") -> str:
        """Only the text rendering of `run`."""
        return self.run(number, tp, lang)["text"]

    def close(self) -> None:
        """Stop the worker processes."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> LiveSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _x(b: int, s: int, h: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, s, h, generator=torch.Generator().manual_seed(seed))  # [b, s, h]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max())


def demo_split(live: LiveSession, tp: int = 2, hidden: int = 16, ffn: int = 64,
               lang: str = "en") -> dict:
    """Answer 1: the weight matrices of one layer, split; together they are the tp=1 weights."""
    ranks = live.spawn(R.mlp_weights, hidden, ffn, tp=tp)
    ref = ParallelMLP(hidden, ffn, CommGroup.single())
    fc1 = torch.cat([r["fc1"] for r in ranks], dim=0)  # columns of A = rows of torch's [out, in]
    fc2 = torch.cat([r["fc2"] for r in ranks], dim=1)
    out = dict(tp=tp, full_fc1=list(ref.fc1.weight.shape), full_fc2=list(ref.fc2.weight.shape),
               per_rank=[dict(rank=i, fc1=list(r["fc1"].shape), fc2=list(r["fc2"].shape))
                         for i, r in enumerate(ranks)],
               max_abs_diff=max(_diff(fc1, ref.fc1.weight), _diff(fc2, ref.fc2.weight)))
    say = Say(lang, "split")
    lines = [say("head", hidden=hidden, ffn=ffn, tp=tp),
             say("full", fc1=out["full_fc1"], fc2=out["full_fc2"])]
    lines += [say("rank", **p) for p in out["per_rank"]]
    lines.append(say("diff", diff=out["max_abs_diff"]))
    return dict(out, text="\n".join(lines))


def demo_mlp_traffic(live: LiveSession, tp: int = 2, b: int = 2, s: int = 4, hidden: int = 16,
                     ffn: int = 64, lang: str = "en") -> dict:
    """Answer 2: column->row sends one all-reduce forward; column->column needs all-gathers."""
    x = _x(b, s, hidden)
    rank0 = live.spawn(R.mlp_traffic, x, hidden, ffn, tp=tp)[0]
    ref = ParallelMLP(hidden, ffn, CommGroup.single())(x)
    ref_cc = ColumnColumnMLP(hidden, ffn, CommGroup.single())(x)
    out, say = dict(tp=tp), Say(lang, "mlp_traffic")
    lines = [say("head", hidden=hidden, ffn=ffn, b=b, s=s, tp=tp)]
    width = max(len(say(name)) for name in ("column_row", "column_column"))
    for name, y_ref in (("column_row", ref), ("column_column", ref_cc)):
        recs = rank0[name]["records"]
        out[name] = dict(records=recs, wire_bytes=sum(r[3] for r in recs),
                         max_abs_diff=_diff(rank0[name]["y"], y_ref.detach()))
        lines.append(say("layout", layout=say(name).ljust(width), records=say.records(recs)))
        lines.append(say("sent", bytes=out[name]["wire_bytes"], diff=out[name]["max_abs_diff"]))
    return dict(out, text="\n".join(lines))


def demo_node(live: LiveSession, tp: int = 2, model: str = "gpt3-175b", hardware: str = "h100",
              seq: int = 2048, b: int = 1, lang: str = "en") -> dict:
    """Answer 3: the planner's per-layer tp traffic inside a node vs across, and a local run."""
    plan = _planner_layer(tp, model, hardware, seq, b)
    measured = live.spawn(R.all_reduce_times, b * 128 * 256, (4,), tp=tp)
    local = max(r[4] for r in measured)
    out = dict(tp=tp, planner=plan, local_layer_s=local, local_numel=b * 128 * 256)
    say = Say(lang, "node")
    lines = [say("head")]
    if plan:
        lines += [say("planner", model=model, b=b, seq=seq, tp=tp, hardware=hardware),
                  say("compute", ms=plan["compute_s"] * 1e3),
                  say("intra", ms=plan["intra_s"] * 1e3, link=plan["intra_link"]),
                  say("inter", ms=plan["inter_s"] * 1e3, link=plan["inter_link"],
                      ratio=plan["inter_s"] / plan["intra_s"])]
    else:
        lines.append(say("no_planner"))
    lines.append(say("measured", b=b, tp=tp, ms=local * 1e3))
    return dict(out, text="\n".join(lines))


def _planner_layer(tp: int, model: str, hardware: str, seq: int, b: int) -> dict | None:
    try:
        from dataclasses import replace

        from tpkit.plan import cost
        from tpkit.plan.hardware import PROFILES
        from tpkit.plan.memory import Precision
        from tpkit.plan.simulate import Layout, tp_collectives
        from tpkit.spec.config import PRESETS
    except ImportError:
        return None
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


def demo_heads(live: LiveSession, tp: int = 2, hidden: int = 64, num_heads: int = 8,
               num_kv_heads: int = 2, lang: str = "en") -> dict:
    """Answer 4: which query and kv heads each rank owns, and its real qkv weight shape."""
    x = _x(2, 4, hidden)
    ranks = live.spawn(R.attention_heads, x, hidden, num_heads, num_kv_heads, tp=tp)
    from tpkit.layers.attention import ParallelAttention

    ref = ParallelAttention(hidden, num_heads, CommGroup.single(), num_kv_heads=num_kv_heads)
    with torch.no_grad():
        y_ref = ref(x)
    say = Say(lang, "heads")
    kv_note = (say("kv_split", n=kv_heads_per_rank(num_kv_heads, tp)) if num_kv_heads >= tp
               else say("kv_shared", n=tp // num_kv_heads))
    arithmetic = [_heads_arithmetic(num_heads, num_kv_heads, tp, i) for i in range(tp)]
    out = dict(tp=tp, heads_per_rank=num_heads // tp, arithmetic=arithmetic, per_rank=[
        dict(rank=i, q_heads=r["q"], kv_heads=r["kv"], qkv_weight=r["qkv"], out_weight=r["out"])
        for i, r in enumerate(ranks)], max_abs_diff=max(_diff(r["y"], y_ref) for r in ranks))
    out["layer_matches_arithmetic"] = [[p["q_heads"], p["kv_heads"]] for p in out["per_rank"]] \
        == arithmetic
    lines = [say("head", hidden=hidden, heads=num_heads, kv=num_kv_heads, tp=tp,
                 per_rank=num_heads // tp, kv_note=kv_note)]
    lines += [say("rank", rank=p["rank"], q=p["q_heads"], kv=p["kv_heads"], qkv=p["qkv_weight"],
                  out=p["out_weight"]) for p in out["per_rank"]]
    lines += [say("match", ok=say.yes_no(out["layer_matches_arithmetic"])),
              say("diff", diff=out["max_abs_diff"])]
    return dict(out, text="\n".join(lines))


def _heads_arithmetic(heads: int, kv: int, tp: int, r: int) -> list[list[int]]:
    """[query heads, kv heads] of rank r: nh/tp consecutive heads; kv split or shared."""
    q = list(range(r * heads // tp, (r + 1) * heads // tp))
    if kv >= tp:
        return [q, list(range(r * kv // tp, (r + 1) * kv // tp))]
    return [q, [q[0] * kv // heads]]  # the kv head its query heads read


def demo_all_reduce(live: LiveSession, tp: int = 2, b: int = 2, s: int = 4, hidden: int = 16,
                    ffn: int = 64, lang: str = "en") -> dict:
    """Answer 5: each rank's partial MLP output; the all-reduce makes them the tp=1 output."""
    x = _x(b, s, hidden)
    ranks = live.spawn(R.mlp_partials, x, hidden, ffn, tp=tp)
    with torch.no_grad():
        y_ref = ParallelMLP(hidden, ffn, CommGroup.single())(x)
    out = dict(tp=tp, partial_vs_ref=[_diff(r["partial"], y_ref) for r in ranks],
               records=ranks[0]["records"],
               sum_vs_ref=_diff(sum(r["partial"] for r in ranks), y_ref),
               all_reduced_vs_ref=max(_diff(r["y"], y_ref) for r in ranks),
               first=[[round(float(v), 4) for v in r["partial"][0, 0, :3]] for r in ranks],
               ref_first=[round(float(v), 4) for v in y_ref[0, 0, :3]])
    say = Say(lang, "all_reduce")
    lines = [say("head", tp=tp, b=b, s=s, hidden=hidden)]
    lines += [say("rank", rank=i, first=f, diff=d)
              for i, (f, d) in enumerate(zip(out["first"], out["partial_vs_ref"]))]
    summed = [round(float(v), 4) for v in sum(r["partial"] for r in ranks)[0, 0, :3]]
    lines += [say("sum", values=summed), say("ref", values=out["ref_first"]),
              say("ledger", records=say.records(out["records"])),
              say("diff", diff=out["all_reduced_vs_ref"])]
    return dict(out, text="\n".join(lines))


def demo_grid(live: LiveSession, tp: int = 2, pp: int = 2, dp: int = 1, lang: str = "en") -> dict:
    """Answer 6: the rank grid of a (tp, pp, dp) mesh, read back from every spawned rank."""
    ranks = live.spawn(R.mesh_coords, tp=tp, pp=pp, dp=dp)
    out = dict(tp=tp, pp=pp, dp=dp, world=tp * pp * dp, grid=rank_grid(tp, pp, dp),
               ranks_per_node=ranks[0]["per_node"], ranks=ranks)
    say = Say(lang, "grid")
    lines = [say("head", world=out["world"], tp=tp, pp=pp, dp=dp, per_node=out["ranks_per_node"])]
    lines += [say("row", d=d, stages="  ".join(f"pp{p}:{g}" for p, g in enumerate(stages)))
              for d, stages in enumerate(out["grid"])]
    lines += [say("rank", rank=r["rank"], dp=r["coord"][0], pp=r["coord"][1], tp=r["coord"][2],
                  tp_group=r["tp"], pp_group=r["pp"], dp_group=r["dp"]) for r in ranks]
    return dict(out, text="\n".join(lines))


def demo_partial_sums(live: LiveSession, tp: int = 2, b: int = 2, s: int = 4, hidden: int = 16,
                      ffn: int = 64, lang: str = "en") -> dict:
    """Answer 7: B split by rows; each rank's Y_r B_r is partial, their sum is Y B."""
    y = _x(b, s, ffn, seed=1)  # the input of the second matrix: [b, s, ffn]
    ranks = live.spawn(R.row_partials, y, ffn, hidden, tp=tp)
    with torch.no_grad():
        ref = RowParallelLinear(ffn, hidden, CommGroup.single(), input_is_parallel=False)
        z_ref = ref(y)
    total = sum(r["partial"] for r in ranks) + ref.bias.detach()
    out = dict(tp=tp, weight_per_rank=[r["weight"] for r in ranks],
               partial_shape=list(ranks[0]["partial"].shape),
               partial_vs_ref=[_diff(r["partial"], z_ref) for r in ranks],
               sum_vs_ref=_diff(total, z_ref))
    say = Say(lang, "partial_sums")
    lines = [say("head", ffn=ffn, hidden=hidden, tp=tp, shape=out["weight_per_rank"][0])]
    lines += [say("rank", rank=i, shape=out["partial_shape"], diff=d)
              for i, d in enumerate(out["partial_vs_ref"])]
    lines.append(say("sum", tp=tp, diff=out["sum_vs_ref"]))
    return dict(out, text="\n".join(lines))


def demo_latency(live: LiveSession, tp: int = 2, counts: tuple[int, ...] = (1, 8, 64),
                 numel: int = 256, model: str = "gpt3-175b", hardware: str = "h100",
                 lang: str = "en") -> dict:
    """Answer 8: repeated small all-reduces add up, measured here and predicted by the planner."""
    ranks = live.spawn(R.all_reduce_times, numel, counts, tp=tp)
    measured = {n: max(r[n] for r in ranks) for n in counts}
    plan = _planner_layer(tp, model, hardware, 2048, 1)
    out = dict(tp=tp, counts=list(counts), measured_s=[measured[n] for n in counts], planner=plan)
    say = Say(lang, "latency")
    lines = [say("head", numel=numel, tp=tp)]
    lines += [say("count", n=n, ms=measured[n] * 1e3, us=measured[n] / n * 1e6) for n in counts]
    if plan:
        n_coll = 4 * plan["layers"]
        steps = ring_steps("all_reduce", tp)
        alpha = [n_coll * steps * a for a in (plan["intra_alpha"], plan["inter_alpha"])]
        out.update(collectives_per_step=n_coll, latency_intra_s=alpha[0], latency_inter_s=alpha[1])
        lines += [say("planner", model=model, n_coll=n_coll, layers=plan["layers"], tp=tp),
                  say("alpha", intra=alpha[0] * 1e3, inter=alpha[1] * 1e3,
                      intra_total=plan["intra_s"] * plan["layers"] * 1e3,
                      inter_total=plan["inter_s"] * plan["layers"] * 1e3)]
    return dict(out, text="\n".join(lines))


DEMOS: dict[int, Callable[..., dict]] = {
    1: demo_split, 2: demo_mlp_traffic, 3: demo_node, 4: demo_heads,
    5: demo_all_reduce, 6: demo_grid, 7: demo_partial_sums, 8: demo_latency,
}
