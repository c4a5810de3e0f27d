"""Two "nodes" on this machine: two torchrun agents (--nnodes 2, --node_rank 0 and 1,
2 processes each, so LOCAL_WORLD_SIZE=2) run `tpkit train` together.

tp=4 x dp=1 must span both nodes: the run still trains but warns, with the reason
(4 all-reduces of the activations per layer and micro-batch over the slow link) and the
planner's price. Its converse, tp=2 inside each node's pair (torchrun numbers node 0's
processes 0,1 and node 1's 2,3) without a warning: test_two_hosts, whose two agents on two
simulated hosts run the same 2 x 2 processes.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_agents(tmp_path, *train_args: str) -> list[subprocess.CompletedProcess]:
    """Both agents' results; a port taken by someone else between choosing it and node
    0's agent binding it is chosen again (node 1 would wait for it until killed)."""
    for _ in range(3):
        out = _run_agents(_free_port(), tmp_path, train_args)
        if not any(_port_taken(p.stderr) for p in out):
            break
    for p in out:
        assert p.returncode == 0, p.stderr[-3000:]
    return out


def _port_taken(stderr: str) -> bool:
    return "EADDRINUSE" in stderr or "address already in use" in stderr.lower()


def _run_agents(port: int, tmp_path, train_args) -> list[subprocess.CompletedProcess]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="default")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
           "2", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    train = ["-m", "tpkit", "train", "--steps", "2", "--global-batch", "4", "--seq", "32",
             "--no-progress", "--out", str(tmp_path), *train_args]
    agents = [subprocess.Popen(cmd + ["--node_rank", str(n)] + train, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for n in (0, 1)]
    out = []
    try:
        for a in agents:
            if out and out[0].returncode != 0 and _port_taken(out[0].stderr):
                a.kill()  # node 1 waits for a store that never came up
            stdout, stderr = a.communicate(timeout=400)
            out.append(subprocess.CompletedProcess(a.args, a.returncode, stdout, stderr))
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    return out


def _tp_groups(procs) -> dict[int, list[int]]:
    text = "".join(p.stdout for p in procs)
    return {int(r): [int(x) for x in g.split(",")]
            for r, g in re.findall(r"rank (\d+): ParallelMesh[^\n]*?tp group \[([\d, ]+)\]", text)}


@pytest.mark.slow
@pytest.mark.timeout(600)  # a 4-process run; a loaded 2-core machine
def test_tp_across_nodes_warns(tmp_path):
    procs = _two_agents(tmp_path / "tp4", "--tp", "4")
    assert _tp_groups(procs) == {r: [0, 1, 2, 3] for r in range(4)}
    assert "loss" in procs[0].stdout  # it still trains; rank 0 reports
    err = procs[0].stderr + procs[1].stderr
    assert "tensor-parallel group of tp=4 spans 2 nodes of 2 ranks each" in err
    assert "keep tp <= 2" in err
    assert re.search(r"Predicted on H100 .*: tp=4 spans 2 nodes.*ms per layer", err)  # the planner's price
