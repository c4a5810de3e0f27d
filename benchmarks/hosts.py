"""Layouts across two simulated hosts at two link speeds: tokens/s of `tpkit train`.

    sudo PYTHONPATH=$PWD/src .venv/bin/python benchmarks/hosts.py [--reps 3] [--steps 40]
        [--seq 64 --global-batch 8]

Two clusters of two hosts each (`tpkit cluster`: network namespaces, links shaped
with tbf), one per link speed (10gbit, 1gbit), both up at once. In each round every
contender runs once, the order rotating: torchrun's two agents (`--nnodes 2
--nproc_per_node 2`, master: host 0) run `tpkit train --preset gpt2-tiny` with

    tp=2 x pp=2   tp inside each host (shared memory), pp across (gloo over the link)
    tp=4          tp across the two hosts (every all-reduce over the link)

A run's tokens/s is its tokens over its step time after `--skip` warm-up steps
(metrics.jsonl); the table shows the median of the rounds and the load average
before and after. Needs root (network namespaces); everything made is removed at the
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

LAYOUTS = {"tp=2 x pp=2 (tp inside hosts)": ["--tp", "2", "--pp", "2"],
           "tp=4 (tp across hosts)": ["--tp", "4"]}
LINKS = {"10gbit": "tpb10g", "1gbit": "tpb1g"}


def _run(layout: Layout, train: list[str], out: Path, args) -> None:
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc_per_node", "2", "--master_addr", layout.host(0), "--master_port", "29500"]
    cmd = ["-m", "tpkit", "train", "--preset", "gpt2-tiny", "--steps", str(args.steps),
           "--seq", str(args.seq), "--global-batch", str(args.global_batch), "--no-progress",
           "--out", str(out), *train]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(enter_argv(layout, n, [*agent, "--node_rank", str(n), *cmd]),
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True) for n in (0, 1)]
    try:
        errs = [a.communicate(timeout=600)[1] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    for a, err in zip(agents, errs):
        if a.returncode != 0:
            raise SystemExit(f"{layout.name}: {' '.join(train)} failed:\n{err[-2000:]}")


def _tokens_per_s(out: Path, skip: int) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_s" in r]  # "tokens": the run's so far
    return (rows[-1]["tokens"] - rows[skip - 1]["tokens"]) / \
        sum(r["step_s"] for r in rows[skip:])


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
    args = p.parse_args()
    clusters = {link: Layout(name, 2, link) for link, name in LINKS.items()}
    contenders = [(link, name) for link in clusters for name in LAYOUTS]
    tps: dict = {c: [] for c in contenders}
    losses: dict = {}
    load = [os.getloadavg()[0]]
    try:
        for layout in clusters.values():
            up(layout)
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.reps):
                for i in range(len(contenders)):
                    link, name = contenders[(i + r) % len(contenders)]
                    out = Path(tmp) / f"r{r}-{i}"
                    _run(clusters[link], LAYOUTS[name], out, args)
                    tps[(link, name)].append(_tokens_per_s(out, args.skip))
                    losses.setdefault(name, set()).add(tuple(_losses(out)))
                    print(f"round {r}: {link:>6} {name}: {tps[(link, name)][-1]:,.0f} tokens/s",
                          flush=True)
    finally:
        for layout in clusters.values():
            down(layout)
    load.append(os.getloadavg()[0])
    _report(tps, losses, load, args)


def _report(tps: dict, losses: dict, load: list[float], args) -> None:
    med = {c: statistics.median(v) for c, v in tps.items()}
    rows = []
    for (link, name), m in med.items():
        base = med[(link, next(iter(LAYOUTS)))]
        rows.append([name, link, f"{m:,.0f}", f"{m / base:.2f}x",
                     " ".join(f"{x:,.0f}" for x in tps[(link, name)])])
    print_table(f"gpt2-tiny, seq {args.seq} x batch {args.global_batch}, 2 simulated hosts x 2 "
                f"processes, medians of {args.reps} rounds (load average {load[0]:.1f} -> "
                f"{load[1]:.1f})",
                ["layout", "link", "tokens/s", "vs tp inside", "runs"], rows)
    same = {name: len(v) == 1 for name, v in losses.items()}
    print(f"every run of a layout had the same losses, at both speeds: {same}")
    runs = {f"{link} {name}": v for (link, name), v in tps.items()}
    path = write_json(f"hosts-seq{args.seq}-batch{args.global_batch}", dict(
        environment=environment(), load=load, reps=args.reps, steps=args.steps,
        tokens_per_s=runs))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
