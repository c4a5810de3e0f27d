"""`tpkit cluster`: simulated hosts made and removed whole, even after `up` is killed
midway; refused in one line without root's capabilities.

The tests that make hosts need root (network namespaces); they use a cluster name of
their own, so a cluster someone else made here is never touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpkit.cluster.checks import missing
from tpkit.cluster.layout import Layout, check_link
from tpkit.spec.errors import UserError

NETNS = Path("/run/netns")  # where `ip netns` keeps its names
needs_root = pytest.mark.skipif(missing() is not None, reason=f"{missing()}")


def tpkit_cluster(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """`tpkit cluster ...` in a subprocess, its output as text."""
    return subprocess.run([sys.executable, "-m", "tpkit", "cluster", *args], text=True,
                          capture_output=True, timeout=timeout, **kw)


def made_by(name: str, env: dict | None = None) -> list[str]:
    """What cluster `name` has on this machine: namespaces, state and shm folders."""
    env = env or os.environ
    ns = sorted(p.name for p in NETNS.glob(f"{name}-*")) if NETNS.is_dir() else []
    dirs = [str(Path(env[k]) / name) for k in ("TPKIT_CLUSTER_DIR", "TPKIT_CLUSTER_SHM")
            if k in env and (Path(env[k]) / name).exists()]
    return ns + dirs


def test_names_and_addresses_come_from_the_name():
    lay = Layout("tpx", 3, "1gbit")
    assert lay.namespaces == ["tpx-sw", "tpx-h0", "tpx-h1", "tpx-h2"]
    assert "10.212.0.3 tpx-h2" in lay.etc_hosts()
    assert lay.index("tpx-h1") == 1 and lay.index("2") == 2
    for bad in (lambda: Layout("Tpx", 2), lambda: Layout("toolongname", 2),
                lambda: Layout("tpx", 0), lambda: lay.index("tpx-h3"),
                lambda: check_link("fast")):
        with pytest.raises(UserError):
            bad()


def test_a_link_passes_no_burst_a_step_would_ride_on():
    """tbf's bucket: a tp all-reduce of gpt2-tiny (128 KiB) must pay the link's rate, so
    the bucket holds less than that at 1 Gbit/s and at most 0.5 ms of any rate above
    (a 10 ms bucket let 1 MiB through "1 Gbit/s" in a sixth of its wire time)."""
    from tpkit.cluster.hosts import burst_bytes

    assert burst_bytes("1gbit") < 128 * 1024
    for rate, bits in (("10gbit", 10e9), ("1gbit", 1e9), ("100mbit", 100e6)):
        held = burst_bytes(rate)
        assert held >= 64 * 1024  # one GSO packet: tbf must not drop what TCP hands it
        assert held * 8 / bits <= max(0.5e-3, 64 * 1024 * 8 / bits)


def test_without_privileges_one_line_names_what_is_missing():
    as_nobody = [] if os.geteuid() != 0 else [
        "setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
        "--inh-caps=-all"]
    out = subprocess.run([*as_nobody, sys.executable, "-m", "tpkit", "cluster", "up",
                          "--name", "tpnopriv"], text=True, capture_output=True, timeout=60,
                         cwd="/")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "making hosts needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN missing" in out.stderr
    assert not (NETNS / "tpnopriv-sw").exists()


def _kill_midway(name: str, env: dict) -> None:
    """Start `up` of many hosts, SIGKILL it once its second host exists."""
    up = subprocess.Popen([sys.executable, "-m", "tpkit", "cluster", "up", "--hosts", "60",
                           "--name", name], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (NETNS / f"{name}-h1").exists() and up.poll() is None and \
                time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        up.send_signal(signal.SIGKILL)
        up.wait(timeout=10)
    assert up.returncode == -signal.SIGKILL  # it was still making hosts
    status = tpkit_cluster("status", env=env)
    assert f"cluster {name}: half made" in status.stdout, status


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(300)
def test_up_killed_midway_is_removed_by_down_or_by_the_next_up(tmp_path):
    name = f"tpk{os.getpid() % 10000}"
    env = dict(os.environ, TPKIT_CLUSTER_DIR=str(tmp_path / "run"),
               TPKIT_CLUSTER_SHM=str(tmp_path / "shm"))
    try:
        _kill_midway(name, env)
        assert f"{name}-h1" in made_by(name, env)
        down = tpkit_cluster("down", "--name", name, env=env)
        assert down.returncode == 0, down.stderr
        assert made_by(name, env) == []

        _kill_midway(name, env)
        up = tpkit_cluster("up", "--hosts", "2", "--link", "1gbit", "--name", name, env=env)
        assert up.returncode == 0, up.stderr
        assert "removed what an interrupted `up`" in up.stdout
        assert made_by(name, env) == sorted([f"{name}-h0", f"{name}-h1", f"{name}-sw"]) + \
            [str(tmp_path / d / name) for d in ("run", "shm")]
        again = tpkit_cluster("up", "--hosts", "2", "--name", name, env=env)
        assert again.returncode == 2 and f"cluster {name} is up" in again.stderr
    finally:
        tpkit_cluster("down", "--name", name, env=env)
    assert made_by(name, env) == []
    assert not (tmp_path / "run").exists() and not (tmp_path / "shm").exists()


@pytest.mark.slow
@needs_root
@pytest.mark.timeout(120)
def test_a_host_has_its_own_name_shm_hosts_and_network(tmp_path):
    name = f"tpq{os.getpid() % 10000}"
    env = dict(os.environ, TPKIT_CLUSTER_DIR=str(tmp_path / "run"),
               TPKIT_CLUSTER_SHM=str(tmp_path / "shm"))
    probe = f"tpkit-probe-{name}"
    try:
        assert tpkit_cluster("up", "--hosts", "2", "--link", "1gbit", "--name", name,
                             env=env).returncode == 0
        said = tpkit_cluster("run", f"{name}-h0", "--", "sh", "-c",
                             f"hostname; touch /dev/shm/{probe}; ls /dev/shm; "
                             f"getent hosts {name}-h1; cat /sys/class/net/eth0/address",
                             env=env)
        assert said.returncode == 0, said.stderr
        lines = said.stdout.split()
        assert lines[:2] == [f"{name}-h0", probe]  # its name; its /dev/shm holds the probe
        assert lines[2:4] == ["10.212.0.2", f"{name}-h1"]
        other = tpkit_cluster("run", f"{name}-h1", "--", "sh", "-c", "hostname; ls /dev/shm",
                              env=env)
        assert other.stdout.split() == [f"{name}-h1"]  # the other host's /dev/shm is empty
        assert not Path(f"/dev/shm/{probe}").exists()  # and so is the machine's, of it
        tc = tpkit_cluster("run", f"{name}-h1", "--", "tc", "qdisc", "show", "dev", "eth0",
                           env=env)
        assert "tbf" in tc.stdout and "rate 1Gbit" in tc.stdout, tc
    finally:
        tpkit_cluster("down", "--name", name, env=env)
    assert made_by(name, env) == []
