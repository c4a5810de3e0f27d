"""Two simulated hosts (`tpkit cluster`: network namespaces, each with its own hostname,
/dev/shm and TCP/IP stack, joined by 1 Gbit/s links): torchrun's two agents (`--nnodes
2`, 2 processes each, `--master_addr` host A's name) train tp=2 inside each host x pp=2
across them. Each rank's start-up line names its groups' transports: shared memory for
tp (inside a host), gloo over the hosts' link for pp (GLOO_SOCKET_IFNAME set from the
route to the master). Every step's loss equals the same run on one host.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_cluster import made_by, needs_root, tpkit_cluster

TRAIN = ["-m", "tpkit", "train", "--preset", "gpt2-tiny", "--tp", "2", "--pp", "2",
         "--steps", "20", "--seq", "32", "--global-batch", "4", "--no-progress"]


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _on_two_hosts(name: str, out: Path, env: dict) -> list[subprocess.CompletedProcess]:
    """Both agents, each inside its host; killed (with the cluster's down) if stuck."""
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc_per_node", "2", "--master_addr", f"{name}-h0", "--master_port", "29500"]
    agents = [subprocess.Popen([sys.executable, "-m", "tpkit", "cluster", "run", f"{name}-h{n}",
                                "--", *agent, "--node_rank", str(n), *TRAIN, "--out", str(out)],
                               env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for n in (0, 1)]
    try:
        said = [a.communicate(timeout=400) for a in agents]
        return [subprocess.CompletedProcess(a.args, a.returncode, *s) for a, s in zip(agents, said)]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(900)  # two 4-process runs on a loaded 2-core machine
def test_tp_inside_hosts_pp_across_matches_one_host(tmp_path):
    name = f"tpt{os.getpid() % 10000}"
    env = dict(os.environ, OMP_NUM_THREADS="1", TPKIT_CLUSTER_DIR=str(tmp_path / "run"),
               TPKIT_CLUSTER_SHM=str(tmp_path / "shm"))
    env.pop("GLOO_SOCKET_IFNAME", None)
    try:
        up = tpkit_cluster("up", "--hosts", "2", "--link", "1gbit", "--name", name, env=env)
        assert up.returncode == 0, up.stderr
        procs = _on_two_hosts(name, tmp_path / "two", env)
    finally:
        tpkit_cluster("down", "--name", name, env=env)
    assert made_by(name, env) == []
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    said = "".join(p.stdout for p in procs)
    ranks = dict(re.findall(r"rank (\d): ParallelMesh.*transports: ([^\n]*)", said))
    assert ranks == {r: "tp shm, pp gloo over eth0" for r in "0123"}, said[-3000:]

    one = subprocess.run([sys.executable, *TRAIN, "--out", str(tmp_path / "one")], env=env,
                         text=True, capture_output=True, timeout=400)
    assert one.returncode == 0, one.stderr[-3000:]
    two, ref = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(ref) == 20 and two == ref  # bit for bit: the same sums in the same order
