"""A host's link goes down mid-collective: what ends the run, and what it leaves.

    sudo PYTHONPATH=$PWD/src .venv/bin/python benchmarks/link_down.py [--timeout 3]

Two simulated hosts (`tpkit cluster`, links of 1 Gbit/s) train gpt2-tiny with pp=2
across them (torchrun's agents, `--master_addr` host 0, one process per host,
`--collective-timeout` of `--timeout` seconds, a checkpoint every 2 steps, far more
steps than it gets to). Once the checkpoint of step 2 is complete, host 1's interface
is set down (`ip link set eth0 down` inside its namespace): its TCP connections are
neither closed nor reset, so every collective across the hosts blocks until the
collective timeout. The script then checks, and prints, what the issue asks of the
fault:

    one clear line   each rank's stderr has exactly one `tpkit train: error:` line,
                     naming the collective that timed out, and no Python traceback
                     from a worker (torchrun's agent prints its own after it: no tpkit
                     code runs in the agent)
    nothing running  both agents ended within --wait seconds of the cut, and no process
                     is left in either host's namespace
    nothing half-    every `step_*` checkpoint in --out is complete (its manifest
    written          readable: `tpkit.checkpoint.retention.complete`); a save the cut
                     interrupted can only be a hidden `.step_*.tmp`, which the next run
                     that takes the folder's lock removes

and exits 1 if any check fails (`--show`: each agent's stderr as well). Too slow for
the test suite (about 18 s: a training start on each host, the checkpoint, the
timeout, the agents' exits); the words of the line are tested in tests/test_restart.py. Needs root; the cluster is removed at
the end, on an error too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import parser
from tpkit.checkpoint.retention import complete
from tpkit.cluster.hosts import down, enter_argv, up
from tpkit.cluster.layout import Layout

TRAIN = ["-m", "tpkit", "train", "--preset", "gpt2-tiny", "--pp", "2", "--steps", "100000",
         "--seq", "32", "--global-batch", "4", "--ckpt-every", "2", "--no-progress"]
LINE = re.compile(r"^tpkit train: error: .*$", re.M)
AGENT_FAILED = "elastic/multiprocessing/api.py"  # torchrun's agent: "... failed (exitcode: 1)"


def _agents(layout: Layout, out: Path, timeout: float) -> list[subprocess.Popen]:
    """torchrun's agent on each host (static rendezvous on host 0, one process each)."""
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc_per_node", "1", "--master_addr", layout.host(0), "--master_port",
             "29500"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return [subprocess.Popen(enter_argv(layout, n, [*agent, "--node_rank", str(n), *TRAIN,
                                                    "--collective-timeout", str(timeout),
                                                    "--out", str(out)]),
                             env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for n in (0, 1)]


def _wait_for_checkpoint(agents: list[subprocess.Popen], done: Path, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not done.is_file():
        if any(a.poll() is not None for a in agents):
            raise SystemExit(f"an agent ended before {done} was written:\n"
                             + "".join(a.communicate()[1][-2000:] for a in agents))
        if time.monotonic() > deadline:
            raise SystemExit(f"no {done} in {limit:.0f} s")
        time.sleep(0.05)


def _ended(agents: list[subprocess.Popen], cut: float, wait: float) -> list[tuple]:
    """(seconds after the cut it ended or None, stderr) of each agent, waiting up to `wait`."""
    ended: list = [None, None]
    while time.monotonic() < cut + wait and None in ended:
        for i, a in enumerate(agents):
            if ended[i] is None and a.poll() is not None:
                ended[i] = time.monotonic() - cut
        time.sleep(0.05)
    for a in agents:
        if a.poll() is None:
            a.kill()
    return [(t, a.communicate()[1]) for t, a in zip(ended, agents)]


def _checks(layout: Layout, out: Path, ended: list[tuple]) -> list[tuple[str, bool, str]]:
    """(check, passed, what was seen) of each property the fault must have."""
    rows = []
    for host, (t, err) in enumerate(ended):
        lines = LINE.findall(err)
        worker_tb = "Traceback" in err.split(AGENT_FAILED, 1)[0]  # the agent's own follows
        rows.append((f"host {host}: one line, no worker traceback",
                     len(lines) == 1 and "timed out" in lines[0] and not worker_tb,
                     lines[0] if len(lines) == 1 else f"{len(lines)} lines: {lines}"))
        rows.append((f"host {host}: its agent ended", t is not None,
                     f"{t:.1f} s after the cut" if t is not None else "still running: killed"))
    left = [p for i in (0, 1) for p in subprocess.run(
        ["ip", "netns", "pids", layout.host(i)], capture_output=True, text=True).stdout.split()]
    rows.append(("nothing left running in the hosts", not left, f"pids {left}" if left else
                 "none"))
    root = out / "checkpoints"
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    whole = sorted(p.name for p in complete(root))
    hidden = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    rows.append(("every step_* checkpoint complete", steps == whole and bool(steps),
                 f"{', '.join(steps)}" + (f"; an interrupted save: {', '.join(hidden)}"
                                          if hidden else "")))
    return rows


def main() -> None:
    """Make the cluster, run, cut host 1's link, check, remove the cluster."""
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=3.0, help="tpkit train --collective-timeout")
    p.add_argument("--wait", type=float, default=90.0,
                   help="seconds the agents get to end after the cut")
    p.add_argument("--name", default=f"ld{os.getpid() % 100000}", help="the cluster's name")
    p.add_argument("--show", action="store_true", help="print each agent's stderr too")
    args = p.parse_args()
    layout = Layout(args.name, 2, "1gbit")
    agents: list[subprocess.Popen] = []
    try:
        up(layout)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            agents = _agents(layout, out, args.timeout)
            _wait_for_checkpoint(agents, out / "checkpoints" / "step_000002" / "manifest.json",
                                 300)
            subprocess.run(["ip", "-n", layout.host(1), "link", "set", "eth0", "down"],
                           check=True)
            cut = time.monotonic()
            ended = _ended(agents, cut, args.wait)
            rows = _checks(layout, out, ended)
            for host, (_, err) in enumerate(ended):
                print(f"--- host {host}'s agent, stderr:\n{err}" if args.show else "", end="")
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
        down(layout)
    for check, ok, seen in rows:
        print(f"{'ok  ' if ok else 'FAIL'} {check}: {seen}")
    sys.exit(0 if all(ok for _, ok, _ in rows) else 1)


if __name__ == "__main__":
    main()
