"""The Megatron MLP, forward + backward: tpkit at tp=2 against PyTorch DTensor at tp=2
and against tp=1, alternated in one run, on gloo with one thread per rank.

    tpkit tp=2     ParallelMLP on mesh.tp_group: f, fc1 (column), gelu, fc2 (row), g
    no ledger      the same model with ledger recording off (its overhead, measured)
    DTensor tp=2   nn.Sequential(fc1, act, fc2) + parallelize_module(ColwiseParallel,
                   RowwiseParallel) on init_device_mesh("cpu", (2,))
    tp=1           ParallelMLP on a group of one, on rank 0 alone (rank 1 waits)

All contenders hold the same weights and are checked to give the same output and
input gradient before they are timed. Both ranks run every tp=2 contender in
lockstep (a barrier before each run); times are rank 0's; each figure is the
median over many interleaved rounds.

    .venv/bin/python benchmarks/mlp_vs_peers.py [--quick] [--budget SECONDS] [--comm gloo]

tpkit's groups use shared memory by default (`--comm auto`); `--comm gloo` gives the
figures of tpkit on gloo (DTensor always runs on gloo). Writes
bench-results/mlp_vs_peers.json (mlp_vs_peers-gloo.json with --comm gloo).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from common import (
    Contender,
    CpuWatch,
    agree,
    check_agree,
    clean_rounds,
    environment,
    fwd_bwd,
    median_ms,
    parser,
    print_table,
    reps_for,
    spread_ms,
    time_once,
    write_json,
    zero,
)
from tpkit.comm.group import CommGroup
from tpkit.launch import spawn
from tpkit.layers import ParallelMLP

TP = 2
OURS, BARE, PEER, SINGLE = "tpkit tp=2", "tpkit tp=2 no ledger", "DTensor tp=2", "tp=1"
TARGETS = dict(vs_dtensor_all=1.0, vs_dtensor_latency=1.3, tp2_vs_tp1_compute=1.8,
               tp2_vs_tp1_8_tokens=1.5, tp2_vs_tp1_64_tokens=1.7, ledger_latency_ms=0.1,
               ledger_compute_fraction=0.01)


@dataclass(frozen=True)
class Shape:
    """x [b, s, h] through fc1 [h -> ffn] and fc2 [ffn -> h]; `regime` labels the row."""

    regime: str  # latency, middle or compute
    b: int
    s: int
    h: int
    ffn: int

    @property
    def tokens(self) -> int:
        return self.b * self.s


SHAPES = [
    Shape("latency", 1, 8, 256, 1024),
    Shape("latency", 2, 16, 256, 1024),
    Shape("latency", 4, 16, 256, 1024),
    Shape("middle", 4, 64, 1024, 4096),
    Shape("compute", 4, 256, 2048, 8192),
    Shape("compute", 8, 256, 2048, 8192),
]
QUICK_SHAPES = [SHAPES[0], SHAPES[3], SHAPES[4]]
BUDGET_S = dict(latency=8.0, middle=12.0, compute=45.0)  # seconds of timed rounds per shape


def dtensor_mlp(ref: ParallelMLP, device_mesh) -> nn.Module:
    """PyTorch's own tensor parallelism on a plain module holding `ref`'s (tp=1) weights."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    h, ffn = ref.fc1.in_features, ref.fc1.out_features
    m = nn.Sequential(OrderedDict(fc1=nn.Linear(h, ffn), act=nn.GELU(approximate="tanh"),
                                  fc2=nn.Linear(ffn, h)))
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            getattr(m, name).weight.copy_(getattr(ref, name).weight)
            getattr(m, name).bias.copy_(getattr(ref, name).bias)
    return parallelize_module(m, device_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def contenders(mesh, shape: Shape, device_mesh, keep: dict, comm_s: list) -> list[Contender]:
    """The four ways of running this shape, with identical weights and inputs; the
    seconds tpkit spent inside collectives (ledger) go to `comm_s`."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape.b, shape.s, shape.h, generator=gen).requires_grad_()  # [b, s, h]
    g = torch.randn(shape.b, shape.s, shape.h, generator=gen)  # [b, s, h], dL/dy
    ours = ParallelMLP(shape.h, shape.ffn, mesh.tp_group, activation="gelu", seed=0)
    single = ParallelMLP(shape.h, shape.ffn, CommGroup.single(), activation="gelu", seed=0)
    peer = dtensor_mlp(single, device_mesh)
    led = mesh.ledger
    return [
        Contender(OURS, fwd_bwd(ours, x, g, keep, OURS), zero(ours, x, led, True, comm_s)),
        Contender(BARE, fwd_bwd(ours, x, g, keep, BARE), zero(ours, x, led, False, comm_s)),
        Contender(PEER, fwd_bwd(peer, x, g, keep, PEER), zero(peer, x)),
        Contender(SINGLE, fwd_bwd(single, x, g, keep, SINGLE), zero(single, x),
                  active=mesh.rank == 0),
    ]


def bench_shape(mesh, shape: Shape, device_mesh, budget_s: float, watch) -> dict | None:
    """Warm up, check, size the run, then time all contenders round-robin in blocks,
    keeping the blocks during which no other program used the CPU."""
    keep: dict = {}
    comm_s: list[float] = []
    cs = contenders(mesh, shape, device_mesh, keep, comm_s)
    warm = [time_once(c, dist.barrier) for c in cs]
    if agree(sum(warm)) < 1.0:  # short rounds: a second warm-up round sizes the run
        warm = [time_once(c, dist.barrier) for c in cs]
    if mesh.rank == 0:
        check_agree(keep, *keep[SINGLE], shape)
    keep.clear()
    comm_s.clear()
    round_s = agree(sum(warm))
    t0 = time.perf_counter()
    times, facts = clean_rounds(cs, reps_for(round_s, budget_s), round_s, dist.barrier, agree,
                                watch, max_s=2 * budget_s)
    if mesh.rank != 0:
        return None
    return dict(shape=asdict(shape), tokens=shape.tokens, wall_s=time.perf_counter() - t0,
                rounds=len(times[OURS]), **facts, comm_ms=median_ms(comm_s),
                median_ms={k: median_ms(v) for k, v in times.items()},
                iqr_ms={k: spread_ms(v) for k, v in times.items()})


def run_all(mesh, shapes: list[Shape], budgets: dict[str, float]) -> list[dict] | None:
    """On every rank: all shapes, one after the other; rank 0 returns the figures."""
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (TP,))
    pids = [None] * TP
    dist.all_gather_object(pids, os.getpid())
    watch = CpuWatch(pids) if mesh.rank == 0 else None
    out = [bench_shape(mesh, s, device_mesh, budgets[s.regime], watch) for s in shapes]
    return out if mesh.rank == 0 else None


def add_ratios(row: dict) -> dict:
    """Speed-ups (greater is better for tpkit) and the ledger's cost."""
    m = row["median_ms"]
    row["ratios"] = dict(ours_vs_dtensor=m[PEER] / m[OURS], tp2_vs_tp1=m[SINGLE] / m[OURS],
                         dtensor_tp2_vs_tp1=m[SINGLE] / m[PEER])
    row["ledger_overhead_ms"] = m[OURS] - m[BARE]
    return row


def verdicts(rows: list[dict]) -> dict:
    """Each target, with the rows it was judged on."""
    vs = [r["ratios"]["ours_vs_dtensor"] for r in rows]
    lat = [r["ratios"]["ours_vs_dtensor"] for r in rows if r["shape"]["regime"] == "latency"]
    comp = [r["ratios"]["tp2_vs_tp1"] for r in rows if r["shape"]["regime"] == "compute"]
    t = TARGETS
    at = {r["tokens"]: r["ratios"]["tp2_vs_tp1"] for r in rows}
    led_lat = [r["ledger_overhead_ms"] for r in rows if r["shape"]["regime"] == "latency"]
    led_comp = [r["ledger_overhead_ms"] / r["median_ms"][BARE] for r in rows
                if r["shape"]["regime"] == "compute"]
    return dict(
        tp2_vs_tp1_8_tokens=dict(target=t["tp2_vs_tp1_8_tokens"], worst=at.get(8),
                                 met=8 in at and at[8] >= t["tp2_vs_tp1_8_tokens"]),
        tp2_vs_tp1_64_tokens=dict(target=t["tp2_vs_tp1_64_tokens"], worst=at.get(64),
                                  met=64 in at and at[64] >= t["tp2_vs_tp1_64_tokens"]),
        ledger_latency_ms=dict(target=t["ledger_latency_ms"], worst=max(led_lat, default=None),
                               met=bool(led_lat) and max(led_lat) <= t["ledger_latency_ms"]),
        ledger_compute_fraction=dict(
            target=t["ledger_compute_fraction"], worst=max(led_comp, default=None),
            met=bool(led_comp) and max(led_comp) <= t["ledger_compute_fraction"]),
        never_slower_than_dtensor=dict(target=t["vs_dtensor_all"], worst=min(vs),
                                       met=min(vs) >= t["vs_dtensor_all"]),
        latency_vs_dtensor=dict(target=t["vs_dtensor_latency"], worst=min(lat, default=None),
                                met=bool(lat) and min(lat) >= t["vs_dtensor_latency"]),
        compute_tp2_vs_tp1=dict(target=t["tp2_vs_tp1_compute"], worst=min(comp, default=None),
                                met=bool(comp) and min(comp) >= t["tp2_vs_tp1_compute"]),
    )


def report(rows: list[dict], verdict: dict) -> None:
    """The table of medians and ratios, then the verdict on each target."""
    cols = ["regime", "b x s", "h / ffn", "rounds used/run", f"{OURS} ms", f"{BARE} ms", f"{PEER} ms",
            f"{SINGLE} ms", "ours vs DTensor", "tp=2 vs tp=1", "DTensor tp=2 vs tp=1",
            "ledger ms", "comm ms", "others' cores"]
    table = []
    for r in rows:
        s, m, q = r["shape"], r["median_ms"], r["ratios"]
        table.append([s["regime"], f"{s['b']}x{s['s']}={r['tokens']}", f"{s['h']}/{s['ffn']}",
                      f"{r['rounds']}/{r['all_rounds']}", *(f"{m[k]:.3f}" for k in (OURS, BARE, PEER, SINGLE)),
                      f"{q['ours_vs_dtensor']:.2f}x", f"{q['tp2_vs_tp1']:.2f}x",
                      f"{q['dtensor_tp2_vs_tp1']:.2f}x", f"{r['ledger_overhead_ms']:+.3f}",
                      f"{r['comm_ms']:.3f}", f"{r['others_cores_median']:.2f}"])
    print_table("MLP forward+backward, 1 thread per rank (medians; ratios: higher = "
                "tpkit tp=2 faster)", cols, table)
    print("  comm ms: tpkit's time inside its two all-reduces (ledger), waiting included.\n"
          "  others' cores: CPU taken by other programs while timing (median over blocks); "
          "blocks above 0.05 cores are dropped.")
    for r in rows:
        if r["used"] != "clean rounds only":
            print(f"  WARNING {r['shape']}: {r['used']}; its figures are skewed")
    for name, v in verdict.items():
        worst = "n/a" if v["worst"] is None else f"{v['worst']:.3f}"
        print(f"  {name:<28} target {v['target']}  worst {worst:>6}  "
              f"{'MET' if v['met'] else 'MISSED'}")


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--comm", choices=["auto", "shm", "gloo"], default="auto",
                   help="transport of tpkit's tp group (default: auto, shared memory here)")
    args = p.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    budgets = {k: (args.budget or v) / (4 if args.quick and args.budget is None else 1)
               for k, v in BUDGET_S.items()}
    t0 = time.perf_counter()
    rows = spawn(run_all, TP, shapes, budgets, mesh=dict(tp=TP, comm=args.comm), threads=1,
                 timeout=1200)[0]
    rows = [add_ratios(r) for r in rows]
    verdict = verdicts(rows)
    report(rows, verdict)
    name = "mlp_vs_peers" + ("-gloo" if args.comm == "gloo" else "")
    path = write_json(name, dict(
        benchmark="mlp_vs_peers", quick=args.quick, tp=TP, comm=args.comm, threads_per_rank=1,
        activation="gelu", timing="rank 0, median over interleaved rounds, barrier before each",
        targets=TARGETS, verdict=verdict, env=environment(),
        total_wall_s=time.perf_counter() - t0, results=rows))
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
