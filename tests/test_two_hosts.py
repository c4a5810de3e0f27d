"""Two simulated hosts (`tpkit cluster`: network namespaces, each with its own hostname,
/dev/shm and TCP/IP stack, joined by 1 Gbit/s links): torchrun's two agents (`--nnodes
2`, 2 processes each, `--master_addr` host A's name) train tp=2 inside each host x pp=2
across them. Each rank's start-up line names its tp group (host A's ranks 0 and 1, so
no warning of a tp group across nodes: test_two_node's tp=4 has one) and its groups'
transports: shared memory for tp (inside a host), gloo over the hosts' link for pp (GLOO_SOCKET_IFNAME set from the
route to the master). Every step's loss equals the same run on one host.

Losing a host: torchrun's c10d rendezvous with `--max-restarts`, every process of host B
killed (its agent too, as a power cut would) once the checkpoint of step 2 is complete,
then a new agent started there: both hosts' workers restart and continue from that
checkpoint (`--resume auto`, the folder shared), every step's loss the uninterrupted
run's. One cluster serves the module's tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proc_tree import PAUSE_WHILE_FLAG
from test_cluster import made_by, needs_root, tpkit_cluster
from tpkit.cluster.checks import missing

TRAIN = ["-m", "tpkit", "train", "--preset", "gpt2-tiny", "--tp", "2", "--pp", "2",
         "--steps", "20", "--seq", "32", "--global-batch", "4", "--no-progress"]


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(name, env) of two hosts joined by 1 Gbit/s links, for the module; removed after."""
    if missing() is not None:
        pytest.skip(missing())
    root = tmp_path_factory.mktemp("cluster")
    name = f"tpt{os.getpid() % 10000}"
    env = dict(os.environ, OMP_NUM_THREADS="1", TPKIT_CLUSTER_DIR=str(root / "run"),
               TPKIT_CLUSTER_SHM=str(root / "shm"))
    env.pop("GLOO_SOCKET_IFNAME", None)
    try:
        up = tpkit_cluster("up", "--hosts", "2", "--link", "1gbit", "--name", name, env=env)
        assert up.returncode == 0, up.stderr
        yield name, env
    finally:
        tpkit_cluster("down", "--name", name, env=env)
    assert made_by(name, env) == []


def _left_in(name: str) -> list[str]:
    """Processes still running inside the cluster's hosts."""
    return [p for i in (0, 1) for p in subprocess.run(
        ["ip", "netns", "pids", f"{name}-h{i}"], capture_output=True, text=True).stdout.split()]


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


def _on_one_host(train: list[str], out: Path, capsys) -> None:
    """The same run on this host, its ranks spawned, through the CLI's entry in this
    process (`tpkit.cli.main`, what the installed `tpkit` runs): no interpreter to start."""
    from tpkit.cli import main

    assert train[:3] == ["-m", "tpkit", "train"], train
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:  # the cluster's agents' environment
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.delenv("GLOO_SOCKET_IFNAME", raising=False)
        assert main([*train[2:], "--out", str(out)]) == 0, capsys.readouterr().err[-3000:]


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(900)  # two 4-process runs on a loaded 2-core machine
def test_tp_inside_hosts_pp_across_matches_one_host(tmp_path, cluster, capsys):
    name, env = cluster
    procs = _on_two_hosts(name, tmp_path / "two", env)
    assert _left_in(name) == []
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    said = "".join(p.stdout for p in procs)
    ranks = {r: (g, t) for r, g, t in re.findall(
        r"rank (\d): ParallelMesh.*tp group \[([\d, ]+)\], transports: ([^\n]*)", said)}
    assert ranks == {r: ("0, 1" if r in "01" else "2, 3", "tp shm, pp gloo over eth0")
                     for r in "0123"}, said[-3000:]  # torchrun's numbering: host A has 0, 1
    assert "tensor-parallel group of tp=" not in "".join(p.stderr for p in procs)  # no warning

    _on_one_host(TRAIN, tmp_path / "one", capsys)
    two, ref = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(ref) == 20 and two == ref  # bit for bit: the same sums in the same order


ELASTIC = ["-m", "tpkit", "train", "--preset", "gpt2-tiny", "--pp", "2", "--steps", "6",
           "--ckpt-every", "2", "--seq", "32", "--global-batch", "4", "--no-progress",
           "--resume", "auto"]


def _elastic_agent(name: str, host: int, out: Path, flag: Path, env: dict) -> subprocess.Popen:
    """Host `host`'s torchrun agent (c10d rendezvous on host 0, one restart allowed); its
    workers pause after each checkpoint file while `flag` exists (the kill lands mid-run)."""
    agent = ["torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{name}-h0:29400", "--rdzv-id",
             "elastic", "--max-restarts", "1", "--monitor-interval", "0.2", "--no-python",
             "sh", "-c", PAUSE_WHILE_FLAG, str(flag), sys.executable]
    return subprocess.Popen([sys.executable, "-m", "tpkit", "cluster", "run", f"{name}-h{host}",
                             "--", sys.executable, "-m", *agent, *ELASTIC, "--out", str(out)],
                            env=dict(env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _lose_host(name: str, host: int) -> None:
    """Every process of host `host` killed at once: its agent, its workers."""
    pids = subprocess.run(["ip", "netns", "pids", f"{name}-h{host}"], capture_output=True,
                          text=True).stdout.split()
    for pid in map(int, pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(600)
def test_a_lost_host_rejoins_and_the_run_finishes_as_if_uninterrupted(tmp_path, cluster, capsys):
    name, env = cluster
    out, flag = tmp_path / "elastic", tmp_path / "pause"
    flag.touch()
    agents = [_elastic_agent(name, h, out, flag, env) for h in (0, 1)]
    try:
        done = out / "checkpoints" / "step_000002" / "manifest.json"
        deadline = time.monotonic() + 300
        while not done.is_file():
            assert all(a.poll() is None for a in agents), "an agent ended before step 2"
            assert time.monotonic() < deadline, "no checkpoint of step 2 in 300 s"
            time.sleep(0.05)
        flag.unlink()  # the restarted workers: no pauses
        _lose_host(name, 1)
        agents[1].communicate(timeout=30)
        agents[1] = _elastic_agent(name, 1, out, flag, env)  # the host is back
        said = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
        _lose_host(name, 0)
        _lose_host(name, 1)
    for a, (_, err) in zip(agents, said):
        assert a.returncode == 0, err[-3000:]
    lost = re.search(r"tpkit train: error: rank 0: .*suspects: rank 1 on host (\S+)\)", said[0][1])
    assert lost and lost[1] == f"{name}-h1", said[0][1][-3000:]  # the lost host, named
    resumed = re.search(r"loss [\d.]+ \(step (\d+)\)", said[0][0] + said[1][0])
    assert resumed and int(resumed[1]) > 2, "the restarted run did not continue a checkpoint"
    assert _left_in(name) == []
    _on_one_host(ELASTIC[:-2], tmp_path / "ref", capsys)
    assert _losses(out) == _losses(tmp_path / "ref")  # every step, bit for bit

