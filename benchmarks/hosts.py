"""Layouts across two simulated hosts at two link speeds: tokens/s of `tpkit train`.

    sudo PYTHONPATH=$PWD/src .venv/bin/python benchmarks/hosts.py [--reps 3] [--steps 40]
        [--seq 64 --global-batch 8] [--per-host 2]

Two clusters of two hosts each (`tpkit cluster`: network namespaces, links shaped
with tbf), one per link speed (10gbit, 1gbit), both up at once. In each round every
contender runs once, the order rotating: torchrun's two agents (`--nnodes 2
--nproc_per_node 2`, master: host 0) run `tpkit train --preset gpt2-tiny` with

    tp=2 x pp=2   tp inside each host (shared memory), pp across (gloo over the link)
    tp=4          tp across the two hosts (every all-reduce over the link)
    tp=2 x dp=2   tp inside each host, the gradients' all-reduce across

With `--per-host 1`, one process per host: pp=2, tp=2 and dp=2, each across the hosts.
On a machine of 2 cores that is a core per process; with 2 per host, 4 processes share
the 2 cores, which the planner models as 1/share of a core each plus a calibrated
latency per collective step (docs/planner.md says where that misses).

Beside each, the planner's prediction from a calibration of the same link under the
same load: each round starts with `tpkit calibrate` of the machine (its cores, shared
memory between the ranks of a host), and right before each run `tpkit calibrate
--across` measures that run's link under torchrun, as many processes per host (gloo over the
link, written as the profile's inter link; the hosts share the machine's cores and each
has one port); `tpkit.plan.evaluate` prices the run (model, sequence, batch,
micro-batches as `tpkit train` picks them, the dp all-reduce after the backward as
tpkit's loop runs it). The planner's error is the median of each run's own ratio.

A run's tokens/s is its tokens over its step time after `--skip` warm-up steps
(metrics.jsonl); the table shows the median of the rounds and the load average
before and after; the JSON keeps each run's calibrated profile and rank 0's median
seconds per step in each group's collectives, to price the runs again. Needs root (network namespaces); everything made is removed at the
end, on an error too.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import environment, parser, print_table, write_json
from tpkit.cluster.hosts import down, enter_argv, up
from tpkit.cluster.layout import Layout
from tpkit.plan import get_hardware
from tpkit.plan.simulate import Cluster, evaluate
from tpkit.plan.simulate import Layout as PlanLayout
from tpkit.spec.config import get_preset
from tpkit.spec.shapes import default_micro_batches

LAYOUTS = {  # processes per host -> layout -> (tp, pp, dp); the first is the table's base
    2: {"tp=2 x pp=2 (tp inside hosts)": (2, 2, 1), "tp=4 (tp across hosts)": (4, 1, 1),
        "tp=2 x dp=2 (dp across hosts)": (2, 1, 2)},
    1: {"pp=2 (pp across hosts)": (1, 2, 1), "tp=2 (tp across hosts)": (2, 1, 1),
        "dp=2 (dp across hosts)": (1, 1, 2)}}


def _argv(degrees: tuple[int, int, int]) -> list[str]:
    return [a for flag, n in zip(("--tp", "--pp", "--dp"), degrees) for a in (flag, str(n))]


def _agents(layout: Layout, argv: list[str], port: str, procs: int) -> list[str]:
    """stderr of torchrun's agents, one per host, running `-m tpkit ARGV`; exits on a
    failure with its last lines."""
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc_per_node", str(procs), "--master_addr", layout.host(0),
             "--master_port", port]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(enter_argv(layout, n, [*agent, "--node_rank", str(n), "-m",
                                                      "tpkit", *argv]),
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for n in (0, 1)]
    try:
        outs = [a.communicate(timeout=600) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    for a, (_, err) in zip(agents, outs):
        if a.returncode != 0:
            raise SystemExit(f"{layout.name}: tpkit {' '.join(argv)} failed:\n{err[-2000:]}")
    return [out for out, _ in outs]


def calibrate_machine(folder: Path, reps: int) -> Path:
    """`tpkit calibrate` of the machine (cores, shared memory between a host's ranks)."""
    base = folder / "machine.toml"
    base.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "tpkit", "calibrate", "--out", str(base), "--reps",
                    str(reps)], check=True, stdout=subprocess.DEVNULL)
    return base


def calibrate_link(base: Path, link: str, layout: Layout, reps: int, procs: int) -> Path:
    """`base` with `link` measured as its inter link (`tpkit calibrate --across`), kept
    beside the results."""
    Path("bench-results").mkdir(exist_ok=True)
    out = Path("bench-results") / f"hosts-{link}.toml"
    out.write_text(base.read_text())
    _agents(layout, ["calibrate", "--across", "--reps", str(reps), "--out", str(out)],
            "29501", procs)  # as many per host as the runs
    return out


def predict(profile: Path, name: str, args) -> float:
    """The planner's tokens/s for one layout of `tpkit train --preset gpt2-tiny` on 2 hosts
    x `--per-host` processes."""
    tp, pp, dp = LAYOUTS[args.per_host][name]
    m = default_micro_batches(pp, args.global_batch // dp)
    lay = PlanLayout(tp, pp, dp, args.global_batch // (dp * m), recompute="none")
    cl = Cluster(get_hardware("local", profile), nodes=2,
                 devices_per_node=args.per_host, overlap_dp=False)
    e = evaluate(get_preset("gpt2-tiny"), args.seq, args.global_batch, lay, cl)
    return e.tokens_per_s
LINKS = {"10gbit": "tpb10g", "1gbit": "tpb1g"}


def _run(layout: Layout, train: list[str], out: Path, args) -> None:
    _agents(layout, ["train", "--preset", "gpt2-tiny", "--steps", str(args.steps), "--seq",
                     str(args.seq), "--global-batch", str(args.global_batch), "--no-progress",
                     "--out", str(out), *train], "29500", args.per_host)


def _tokens_per_s(out: Path, skip: int) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_s" in r]  # "tokens": the run's so far
    return (rows[-1]["tokens"] - rows[skip - 1]["tokens"]) / \
        sum(r["step_s"] for r in rows[skip:])


def _comm(out: Path, skip: int) -> dict:
    """Rank 0's median seconds per step in each group's collectives (metrics.jsonl)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r["comm"] for r in rows if "step_s" in r][skip:]
    return {g: statistics.median(r[g]["seconds"] for r in rows if g in r) for g in rows[-1]}


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def main() -> None:
    """Make the clusters, run the rounds, print the table, remove the clusters."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="rounds (each runs every contender)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    p.add_argument("--seq", type=int, default=64, help="tpkit train --seq")
    p.add_argument("--global-batch", type=int, default=8, help="tpkit train --global-batch")
    p.add_argument("--prefix", default="tpb", help="the clusters' names start with it")
    p.add_argument("--calibrate-reps", type=int, default=10, help="tpkit calibrate --reps")
    p.add_argument("--per-host", type=int, choices=(1, 2), default=2,
                   help="processes per host: 2 (the layouts above; 4 processes share this "
                        "machine's cores when it has fewer than 4) or 1 (pp=2, tp=2, dp=2 "
                        "across the hosts, a core each on 2 cores)")
    args = p.parse_args()
    clusters = {link: Layout(args.prefix + name.removeprefix("tpb"), 2, link)
                for link, name in LINKS.items()}
    layouts = LAYOUTS[args.per_host]
    contenders = [(link, name) for link in clusters for name in layouts]
    tps: dict = {c: [] for c in contenders}
    pred: dict = {c: [] for c in contenders}
    profiles: dict = {c: [] for c in contenders}  # each run's calibration, to re-price it
    comm: dict = {c: [] for c in contenders}
    losses: dict = {}
    load = [os.getloadavg()[0]]
    try:
        for layout in clusters.values():
            up(layout)
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.reps):
                base = calibrate_machine(Path(tmp), args.calibrate_reps)
                for i in range(len(contenders)):
                    link, name = contenders[(i + r) % len(contenders)]
                    profile = calibrate_link(base, link, clusters[link], args.calibrate_reps,
                                             args.per_host)
                    pred[(link, name)].append(predict(profile, name, args))
                    profiles[(link, name)].append(profile.read_text())
                    out = Path(tmp) / f"r{r}-{i}"
                    _run(clusters[link], _argv(layouts[name]), out, args)
                    tps[(link, name)].append(_tokens_per_s(out, args.skip))
                    comm[(link, name)].append(_comm(out, args.skip))
                    losses.setdefault(name, set()).add(tuple(_losses(out)))
                    print(f"round {r}: {link:>6} {name}: {tps[(link, name)][-1]:,.0f} tokens/s, "
                          f"planner {pred[(link, name)][-1]:,.0f} (load "
                          f"{os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for layout in clusters.values():
            down(layout)
    load.append(os.getloadavg()[0])
    _report(tps, pred, losses, load, args, dict(profiles=profiles, comm=comm))


def _report(tps: dict, pred: dict, losses: dict, load: list[float], args,
            runs_kept: dict) -> None:
    """Medians of the rounds; the planner's error is the median of each round's ratio of
    step times (its calibration and its run under the same load)."""
    med = {c: statistics.median(v) for c, v in tps.items()}
    rows = []
    for (link, name), m in med.items():
        base = med[(link, next(iter(LAYOUTS[args.per_host])))]
        ratios = [t / p for t, p in zip(tps[(link, name)], pred[(link, name)])]
        rows.append([name, link, f"{m:,.0f}", f"{m / base:.2f}x",
                     f"{statistics.median(pred[(link, name)]):,.0f}",
                     f"{statistics.median(ratios) - 1:+.0%}",
                     " ".join(f"{r - 1:+.0%}" for r in ratios)])
    print_table(f"gpt2-tiny, seq {args.seq} x batch {args.global_batch}, 2 simulated hosts x "
                f"{args.per_host} processes, medians of {args.reps} rounds (load average {load[0]:.1f} -> "
                f"{load[1]:.1f})",
                ["layout", "link", "tokens/s", "vs the first", "planner", "step time: planner "
                 "vs measured", "each round"], rows)
    same = {name: len(v) == 1 for name, v in losses.items()}
    print(f"every run of a layout had the same losses, at both speeds: {same}")
    runs = {f"{link} {name}": v for (link, name), v in tps.items()}
    per = "" if args.per_host == 2 else f"-per{args.per_host}"
    path = write_json(f"hosts-seq{args.seq}-batch{args.global_batch}{per}", dict(
        environment=environment(), load=load, reps=args.reps, steps=args.steps,
        tokens_per_s=runs, predicted={f"{k[0]} {k[1]}": v for k, v in pred.items()},
        **{what: {f"{k[0]} {k[1]}": v for k, v in kept.items()}
           for what, kept in runs_kept.items()}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
