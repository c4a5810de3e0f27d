"""Fault-tolerant training across two "nodes": two torchrun agents on this machine
(`--nnodes 2 --nproc-per-node 1`, c10d rendezvous, `--max-restarts 1`), gloo.

Layout pp=2, one pipeline stage per node: the multi-node recipe puts pp across nodes
and keeps tp inside one (tp inside a node under torchrun is tests/test_two_node.py);
two workers in all keep it light on two cores. The second node's worker (rank 1,
the last stage, which computes the loss) is killed with SIGKILL once the checkpoint
of step 2 is complete. Its agent restarts; the first agent sees a node waiting (or
its own rank fail) and restarts too, and both workers continue from the newest
complete checkpoint in the shared --out, where only rank 0 writes metrics.jsonl, the
plot and the manifests. Every step's loss equals an uninterrupted two-node run's.

The agents' restart counts differ (only the failed node's agent counts a restart),
so the restarted ranks must agree on their store keys some other way
(`tpkit.comm.incarnation`). The kill lands mid-run by construction: while a flag
file exists, each worker starts with TPKIT_CKPT_PAUSE_S (a pause after each
checkpoint file, three paused saves still to go); the test removes the flag before
the kill, so the restarted workers run at full speed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proc_tree import PAUSE_WHILE_FLAG, cmdline, descendants, wait_gone

SRC = str(Path(__file__).resolve().parents[1] / "src")
STEPS = 8
TRAIN = ["train", "--pp", "2", "--steps", str(STEPS), "--ckpt-every", "2", "--seq", "32",
         "--global-batch", "4", "--no-progress", "--resume", "auto"]
DEADLINE_S = 200  # generous: the machine may be busy; nothing here asserts on time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(out: Path, flag: Path) -> list[subprocess.Popen]:
    """Two torchrun agents (the two "nodes") of one c10d rendezvous, training into `out`."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "1", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{_free_port()}", "--rdzv-id", out.name, "--no-python",
           "sh", "-c", PAUSE_WHILE_FLAG, str(flag),
           sys.executable, "-m", "tpkit", *TRAIN, "--out", str(out)]
    return [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, start_new_session=True) for _ in range(2)]


def _finish(agents: list[subprocess.Popen]) -> list[str]:
    """Wait for both agents; their stdout. Fails naming the errors if one did not exit 0."""
    said = [a.communicate(timeout=DEADLINE_S) for a in agents]
    for a, (_, err) in zip(agents, said):
        assert a.returncode == 0, [x for x in err.splitlines() if "rror" in x][-10:]
    return [out for out, _ in said]


def _kill_all(agents: list[subprocess.Popen], seen: set[int]) -> None:
    """SIGKILL the agents and every worker (in sessions of their own) seen or still there."""
    for a in agents:
        seen.update(descendants(a.pid))
    for pid in [a.pid for a in agents] + sorted(seen):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for a in agents:
        try:
            a.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _workers(agents: list[subprocess.Popen]) -> dict[int, int]:
    """global rank -> pid of the `tpkit train` workers running under the agents now."""
    out = {}
    for pid in (p for a in agents for p in descendants(a.pid)):
        if " tpkit train " in cmdline(pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = pid
    return out


def _wait_for(what: str, ready, agents: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        assert all(a.poll() is None for a in agents), f"an agent exited before {what}"
        assert time.monotonic() < deadline, f"no {what} after {DEADLINE_S} s"
        time.sleep(0.05)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines() if r]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"metrics.jsonl steps {steps}: written twice?"
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_worker_killed_on_the_second_node_restarts_both_and_matches(tmp_path):
    seen: set[int] = set()
    agents = _agents(tmp_path / "whole", tmp_path / "no-flag")
    try:
        _finish(agents)
        flag, out = tmp_path / "pause", tmp_path / "killed"
        flag.touch()
        agents = _agents(out, flag)
        ckpt = out / "checkpoints"  # 3 paused saves to go: the kill lands mid-run
        _wait_for("checkpoint 2", (ckpt / "step_000002" / "manifest.json").is_file, agents)
        workers = _workers(agents)
        seen.update(workers.values())
        assert sorted(workers) == [0, 1], {r: cmdline(p) for r, p in workers.items()}
        flag.unlink()  # the restarted workers: no pauses
        os.kill(workers[1], signal.SIGKILL)  # the second node's worker (rank 1: stage 1)
        said = _finish(agents)
        left = [p for p in descendants(1) if str(out) in cmdline(p)]
        assert wait_gone(left, 30)[1] == []  # no worker of either incarnation outlived the job
    finally:
        _kill_all(agents, seen)
    for rank in (0, 1):  # each node started its worker twice: both restarted
        lines = [x for x in "".join(said).splitlines() if x.startswith(f"rank {rank}: Parallel")]
        assert len(lines) == 2, lines
    resumed = re.search(r"loss [\d.]+ \(step (\d+)\)", said[0] + said[1])
    assert resumed and int(resumed[1]) > 1, "the restarted run did not continue a checkpoint"
    a, b = _losses(tmp_path / "whole"), _losses(out)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    diff = max(abs(a[s] - b[s]) for s in a)
    print(f"resumed at step {resumed[1]}; max |loss difference| over {STEPS} steps: {diff:.3g}")
    assert diff <= 1e-6, (a, b)
