"""Live demonstrations: each quiz answer proved by a real run of the library on CPU processes.

    with LiveSession() as live:
        figures = live.run(2, tp=4)      # dict of computed figures, and figures["text"]

One function per answer (`DEMOS[n]`); each spawns gloo ranks (processes are kept in
a pool per world size and reused), runs the real layers, collectives and ledger, and
returns what it measured. Nothing is canned: change tp and the figures change.
The per-rank functions live in `live_ranks` (module level, so they pickle).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpkit.comm.group import CommGroup
from tpkit.layers import ColumnColumnMLP, ParallelMLP, RowParallelLinear
from tpkit.mesh import rank_grid
from tpkit.quiz import live_ranks as R

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

    def run(self, number: int, tp: int = 2) -> dict:
        """Demonstration `number` (1..8) at tensor-parallel size `tp`."""
        if number not in DEMOS:
            raise ValueError(f"no demonstration {number}; they are numbered 1 to 8")
        return DEMOS[number](self, tp=tp)

    def text(self, number: int, tp: int = 2) -> str:
        """Only the text rendering of `run`."""
        return self.run(number, tp)["text"]

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


def demo_split(live: LiveSession, tp: int = 2, hidden: int = 16, ffn: int = 64) -> dict:
    """Answer 1: the weight matrices of one layer, split; together they are the tp=1 weights."""
    ranks = live.spawn(R.mlp_weights, hidden, ffn, tp=tp)
    ref = ParallelMLP(hidden, ffn, CommGroup.single())
    fc1 = torch.cat([r["fc1"] for r in ranks], dim=0)  # columns of A = rows of torch's [out, in]
    fc2 = torch.cat([r["fc2"] for r in ranks], dim=1)
    out = dict(tp=tp, full_fc1=list(ref.fc1.weight.shape), full_fc2=list(ref.fc2.weight.shape),
               per_rank=[dict(rank=i, fc1=list(r["fc1"].shape), fc2=list(r["fc2"].shape))
                         for i, r in enumerate(ranks)],
               max_abs_diff=max(_diff(fc1, ref.fc1.weight), _diff(fc2, ref.fc2.weight)))
    lines = [f"MLP h={hidden}, ffn={ffn} on tp={tp} ranks (torch stores weights as [out, in])",
             f"  tp=1: fc1 {out['full_fc1']}  fc2 {out['full_fc2']}"]
    lines += [f"  rank {p['rank']}: fc1 {p['fc1']} (columns of A)  fc2 {p['fc2']} (rows of B)"
              for p in out["per_rank"]]
    lines.append(f"  shards put back together vs tp=1 weights: max |diff| = {out['max_abs_diff']:.1e}")
    return dict(out, text="\n".join(lines))


def demo_mlp_traffic(live: LiveSession, tp: int = 2, b: int = 2, s: int = 4, hidden: int = 16,
                     ffn: int = 64) -> dict:
    """Answer 2: column->row sends one all-reduce forward; column->column needs all-gathers."""
    x = _x(b, s, hidden)
    rank0 = live.spawn(R.mlp_traffic, x, hidden, ffn, tp=tp)[0]
    ref = ParallelMLP(hidden, ffn, CommGroup.single())(x)
    ref_cc = ColumnColumnMLP(hidden, ffn, CommGroup.single())(x)
    out = dict(tp=tp)
    lines = [f"MLP h={hidden}, ffn={ffn}, x [{b}, {s}, {hidden}], tp={tp}: ledger of rank 0"]
    for name, title, y_ref in (("column_row", "column -> row   ", ref),
                               ("column_column", "column -> column", ref_cc)):
        recs = rank0[name]["records"]
        out[name] = dict(records=recs, wire_bytes=sum(r[3] for r in recs),
                         max_abs_diff=_diff(rank0[name]["y"], y_ref.detach()))
        lines.append(f"  {title}: " + ", ".join(f"{op} {phase} of {n} floats"
                                                 for op, phase, n, _ in recs))
        lines.append(f"    {out[name]['wire_bytes']:.0f} bytes sent by this rank; "
                     f"output vs tp=1 max |diff| = {out[name]['max_abs_diff']:.1e}")
    return dict(out, text="\n".join(lines))


def demo_node(live: LiveSession, tp: int = 2, model: str = "gpt3-175b", hardware: str = "h100",
              seq: int = 2048, b: int = 1) -> dict:
    """Answer 3: the planner's per-layer tp traffic inside a node vs across, and a local run."""
    plan = _planner_layer(tp, model, hardware, seq, b)
    measured = live.spawn(R.all_reduce_times, b * 128 * 256, (4,), tp=tp)
    local = max(r[4] for r in measured)
    out = dict(tp=tp, planner=plan, local_layer_s=local, local_numel=b * 128 * 256)
    lines = ["4 all-reduces of the activations per layer and micro-batch (2 forward, 2 backward)"]
    if plan:
        lines += [f"planner, {model} (b={b}, s={seq}, bf16), tp={tp} on {hardware}:",
                  f"  compute per layer            {plan['compute_s'] * 1e3:8.3f} ms",
                  f"  tp traffic inside a node     {plan['intra_s'] * 1e3:8.3f} ms  "
                  f"({plan['intra_link']})",
                  f"  tp traffic across nodes      {plan['inter_s'] * 1e3:8.3f} ms  "
                  f"({plan['inter_link']}): x{plan['inter_s'] / plan['intra_s']:.1f}"]
    else:
        lines.append("planner (tpkit.plan) not available in this build")
    lines.append(f"measured here: 4 all-reduces of [{b}, 128, 256] fp32 on {tp} local "
                 f"processes: {local * 1e3:.2f} ms")
    return dict(out, text="\n".join(lines))


def _planner_layer(tp: int, model: str, hardware: str, seq: int, b: int) -> dict | None:
    try:
        from dataclasses import replace

        from tpkit.model.config import PRESETS
        from tpkit.plan import cost
        from tpkit.plan.hardware import PROFILES
    except ImportError:
        return None
    c, hw = PRESETS[model], PROFILES[hardware]
    n = b * seq * c.hidden * 2  # bytes of one bf16 activation [b, s, h]
    flops = cost.layer_forward_flops(c, b, seq)
    compute = 3 * (cost.gemm_time(flops["gemm"] / tp, hw.accelerator, min(b * seq, c.hidden / tp))
                   + cost.gemm_time(flops["attention"] / tp, hw.accelerator, c.head_dim))
    one_per_node = replace(hw, devices_per_node=1)  # the same group, one GPU per node
    return dict(compute_s=compute, bytes=n, intra_link=hw.intra.name, inter_link=hw.inter.name,
                intra_s=4 * cost.all_reduce_time(n, tp, cost.link_for(tp, hw)),
                inter_s=4 * cost.all_reduce_time(n, tp, cost.link_for(tp, one_per_node)),
                layers=c.num_layers, inter_alpha=hw.inter.latency, intra_alpha=hw.intra.latency)


def demo_heads(live: LiveSession, tp: int = 2, hidden: int = 64, num_heads: int = 8,
               num_kv_heads: int = 2) -> dict:
    """Answer 4: which query and kv heads each rank owns, and its real qkv weight shape."""
    x = _x(2, 4, hidden)
    ranks = live.spawn(R.attention_heads, x, hidden, num_heads, num_kv_heads, tp=tp)
    from tpkit.layers.attention import ParallelAttention

    ref = ParallelAttention(hidden, num_heads, CommGroup.single(), num_kv_heads=num_kv_heads)
    with torch.no_grad():
        y_ref = ref(x)
    kv_note = (f"{num_kv_heads // tp} kv head(s) each" if num_kv_heads >= tp
               else f"each kv head shared by {tp // num_kv_heads} ranks")
    arithmetic = [_heads_arithmetic(num_heads, num_kv_heads, tp, i) for i in range(tp)]
    out = dict(tp=tp, heads_per_rank=num_heads // tp, arithmetic=arithmetic, per_rank=[
        dict(rank=i, q_heads=r["q"], kv_heads=r["kv"], qkv_weight=r["qkv"], out_weight=r["out"])
        for i, r in enumerate(ranks)], max_abs_diff=max(_diff(r["y"], y_ref) for r in ranks))
    out["layer_matches_arithmetic"] = [[p["q_heads"], p["kv_heads"]] for p in out["per_rank"]] \
        == arithmetic
    lines = [f"attention h={hidden}, {num_heads} query heads, {num_kv_heads} kv heads (GQA), "
             f"tp={tp}: {num_heads}/{tp} = {num_heads // tp} query heads per rank, {kv_note}"]
    lines += [f"  rank {p['rank']}: query heads {p['q_heads']}, kv heads {p['kv_heads']}; "
              f"qkv weight {p['qkv_weight']}, out weight {p['out_weight']}" for p in out["per_rank"]]
    lines.append(f"  heads the layer took == heads the arithmetic gives: "
                 f"{out['layer_matches_arithmetic']}")
    lines.append(f"  attention output after the one all-reduce vs tp=1: "
                 f"max |diff| = {out['max_abs_diff']:.1e}")
    return dict(out, text="\n".join(lines))


def _heads_arithmetic(heads: int, kv: int, tp: int, r: int) -> list[list[int]]:
    """[query heads, kv heads] of rank r: nh/tp consecutive heads; kv split or shared."""
    q = list(range(r * heads // tp, (r + 1) * heads // tp))
    if kv >= tp:
        return [q, list(range(r * kv // tp, (r + 1) * kv // tp))]
    return [q, [q[0] * kv // heads]]  # the kv head its query heads read


def demo_all_reduce(live: LiveSession, tp: int = 2, b: int = 2, s: int = 4, hidden: int = 16,
                    ffn: int = 64) -> dict:
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
    lines = [f"MLP on tp={tp} ranks, x [{b}, {s}, {hidden}]: fc2 gives each rank a partial output"]
    lines += [f"  rank {i}: partial[0, 0, :3] = {f}  (vs tp=1: max |diff| = {d:.3f})"
              for i, (f, d) in enumerate(zip(out["first"], out["partial_vs_ref"]))]
    summed = [round(float(v), 4) for v in sum(r["partial"] for r in ranks)[0, 0, :3]]
    lines += [f"  sum of the partials       = {summed}",
              f"  tp=1 output[0, 0, :3]     = {out['ref_first']}",
              "  ledger: " + ", ".join(f"{op} {phase} of {n} floats"
                                        for op, phase, n, _ in out["records"]),
              f"  all-reduced output vs tp=1: max |diff| = {out['all_reduced_vs_ref']:.1e}"]
    return dict(out, text="\n".join(lines))


def demo_grid(live: LiveSession, tp: int = 2, pp: int = 2, dp: int = 1) -> dict:
    """Answer 6: the rank grid of a (tp, pp, dp) mesh, read back from every spawned rank."""
    ranks = live.spawn(R.mesh_coords, tp=tp, pp=pp, dp=dp)
    out = dict(tp=tp, pp=pp, dp=dp, world=tp * pp * dp, grid=rank_grid(tp, pp, dp),
               ranks=[{k: v for k, v in r.items() if k != "describe"} for r in ranks])
    lines = [ranks[0]["describe"]]
    lines += [f"  rank {r['rank']}: (dp={r['coord'][0]}, pp={r['coord'][1]}, tp={r['coord'][2]}) "
              f"tp group {r['tp']}, pp group {r['pp']}, dp group {r['dp']}" for r in out["ranks"]]
    return dict(out, text="\n".join(lines))


def demo_partial_sums(live: LiveSession, tp: int = 2, b: int = 2, s: int = 4, hidden: int = 16,
                      ffn: int = 64) -> dict:
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
    lines = [f"second matrix B [{ffn} -> {hidden}] split by rows over tp={tp}: rank r holds "
             f"B_r of shape {out['weight_per_rank'][0]} (as [out, in])"]
    lines += [f"  rank {i}: Y_{i} B_{i} has the full output shape {out['partial_shape']}, "
              f"but differs from Y B by up to {d:.3f}" for i, d in enumerate(out["partial_vs_ref"])]
    lines.append(f"  sum over the {tp} ranks vs Y B on one device: max |diff| = "
                 f"{out['sum_vs_ref']:.1e}")
    return dict(out, text="\n".join(lines))


def demo_latency(live: LiveSession, tp: int = 2, counts: tuple[int, ...] = (1, 8, 64),
                 numel: int = 256, model: str = "gpt3-175b", hardware: str = "h100") -> dict:
    """Answer 8: repeated small all-reduces add up, measured here and predicted by the planner."""
    ranks = live.spawn(R.all_reduce_times, numel, counts, tp=tp)
    measured = {n: max(r[n] for r in ranks) for n in counts}
    plan = _planner_layer(tp, model, hardware, 2048, 1)
    out = dict(tp=tp, counts=list(counts), measured_s=[measured[n] for n in counts], planner=plan)
    lines = [f"{numel} floats all-reduced N times in a row on {tp} local processes:"]
    lines += [f"  N={n:3d}: {measured[n] * 1e3:8.3f} ms  ({measured[n] / n * 1e6:7.1f} us each)"
              for n in counts]
    if plan:
        n_coll = 4 * plan["layers"]
        alpha = [n_coll * 2 * (tp - 1) * a for a in (plan["intra_alpha"], plan["inter_alpha"])]
        out.update(collectives_per_step=n_coll, latency_intra_s=alpha[0], latency_inter_s=alpha[1])
        lines += [f"planner, {model}: {n_coll} tp all-reduces per micro-batch "
                  f"({plan['layers']} layers x 4), latency alone (2(p-1) alpha each) at tp={tp}:",
                  f"  inside a node {alpha[0] * 1e3:.3f} ms, across nodes {alpha[1] * 1e3:.3f} ms; "
                  f"with transfers {plan['intra_s'] * plan['layers'] * 1e3:.1f} ms vs "
                  f"{plan['inter_s'] * plan['layers'] * 1e3:.1f} ms"]
    return dict(out, text="\n".join(lines))


DEMOS: dict[int, Callable[..., dict]] = {
    1: demo_split, 2: demo_mlp_traffic, 3: demo_node, 4: demo_heads,
    5: demo_all_reduce, 6: demo_grid, 7: demo_partial_sums, 8: demo_latency,
}
