"""Up, down, run, status of a simulated cluster (`layout.Layout`), with ip, tc, unshare.

The hosts' links plug into a bridge inside a namespace of their own (the switch), so
the machine's own network namespace never sees an interface or an address of the
cluster. A link's rate is shaped by tbf at both of its ends (each direction).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

from tpkit.cluster.checks import require
from tpkit.cluster.layout import Layout, read_state, shm_root, state_root, write_state
from tpkit.spec.errors import UserError

# run: a UTS and mount namespace of the host's name, /dev/shm and /etc/hosts
_ENTER = ('hostname "$0" && mount --bind "$1" /dev/shm && mount --bind "$2" /etc/hosts '
          '&& shift 2 && exec "$@"')
_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9}


def _ip(*args: str, tool: str = "ip") -> str:
    """Run `ip ...` (or tc); a failure is one line naming the command and its error."""
    cmd = [tool, *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        raise UserError(f"`{' '.join(cmd)}` did not answer in 60 s") from e
    if out.returncode != 0:
        said = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"`{' '.join(cmd)}` failed: {said}")
    return out.stdout


def namespaces() -> set[str]:
    """The network namespaces `ip netns` knows."""
    return {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}


def burst_bytes(rate: str) -> int:
    """tbf's bucket for `rate`: 0.5 ms of the rate, at least 64 KiB (one GSO packet).

    A port sends no faster than its rate; what the bucket holds passes at the speed of
    the veth pair instead. A bucket of 10 ms (1.25 MB at 1 Gbit/s) let a training step's
    all-reduces through unshaped: a 1 MiB one took 1.4 ms on "1 Gbit/s", a sixth of its
    8.4 ms on the wire, while the calibration's 16 MiB ones drained it, so no one latency
    and bandwidth fitted both. With 64 KiB the rate holds from 128 KiB up."""
    number, unit = rate.removesuffix("bit")[:-1], rate.removesuffix("bit")[-1]
    bits = float(number) * _UNITS[unit] if unit in _UNITS else float(number + unit)
    return max(int(bits / 8 / 2000), 64 * 1024)


def _shape(ns: str, dev: str, rate: str) -> None:
    _ip("-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst",
        str(burst_bytes(rate)), "latency", "50ms", tool="tc")


def _make_host(layout: Layout, i: int) -> None:
    host, sw = layout.host(i), layout.switch
    _ip("netns", "add", host)
    _ip("-n", host, "link", "set", "lo", "up")
    _ip("-n", sw, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", host)
    _ip("-n", sw, "link", "set", f"v{i}", "master", "br0", "up")
    _ip("-n", host, "addr", "add", f"{layout.address(i)}/24", "dev", "eth0")
    _ip("-n", host, "link", "set", "eth0", "up")
    if layout.link:
        _shape(host, "eth0", layout.link)
        _shape(sw, f"v{i}", layout.link)
    layout.hosts_file(i).parent.mkdir(parents=True, exist_ok=True)
    layout.hosts_file(i).write_text(layout.etc_hosts())
    layout.shm_dir(i).mkdir(parents=True, exist_ok=True)
    layout.shm_dir(i).chmod(0o1777)


def up(layout: Layout) -> list[str]:
    """Make the cluster; returns the lines to print. A cluster of that name half made by
    an interrupted `up` is removed first; one fully up is refused."""
    require()
    said = []
    found = read_state(layout.name)
    if found and found[1]:
        raise UserError(f"cluster {layout.name} is up ({found[0].hosts} hosts): "
                        f"`tpkit cluster down --name {layout.name}` first")
    if found:
        said += down(found[0])
        said.append(f"removed what an interrupted `up` of cluster {layout.name} had made")
    taken = sorted(namespaces() & set(layout.namespaces))
    if taken:
        raise UserError(f"network namespace {taken[0]} exists and is not cluster "
                        f"{layout.name}'s (no state file); choose another --name")
    write_state(layout, complete=False)  # before anything exists: down finds it all
    try:
        _ip("netns", "add", layout.switch)
        _ip("-n", layout.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", layout.switch, "link", "set", "br0", "up")
        for i in range(layout.hosts):
            _make_host(layout, i)
    except BaseException:
        down(layout)
        raise
    write_state(layout, complete=True)
    return said + status_lines(layout, True)


def _stop_processes(ns: str) -> int:
    """Kill what still runs in namespace `ns` (TERM, then KILL after 2 s); how many."""
    pids = [int(p) for p in _ip("netns", "pids", ns).split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2
        while sig == signal.SIGTERM and time.monotonic() < deadline and \
                _ip("netns", "pids", ns).split():
            time.sleep(0.1)
    return len(pids)


def down(layout: Layout) -> list[str]:
    """Remove every object the cluster names (its namespaces, with the processes still
    in them, its files); what exists of them, after a complete or an interrupted up."""
    require()
    said, present = [], namespaces()
    for ns in reversed(layout.namespaces):
        if ns in present:
            killed = _stop_processes(ns)
            if killed:
                said.append(f"{ns}: stopped {killed} processes still running there")
            _ip("netns", "del", ns)
    shutil.rmtree(layout.shm_dir(0).parent, ignore_errors=True)
    shutil.rmtree(layout.state_dir, ignore_errors=True)
    for root in (shm_root(), state_root()):  # made by the first up; kept while not empty
        with contextlib.suppress(OSError):
            root.rmdir()
    return said + [f"cluster {layout.name}: down ({len(layout.namespaces)} namespaces)"]


def recorded(name: str) -> Layout:
    """The cluster `name` as `up` recorded it, else a UserError."""
    found = read_state(name)
    if found is None:
        raise UserError(f"no cluster named {name} is up (`tpkit cluster up --name {name}`)")
    if not found[1]:
        raise UserError(f"cluster {name} is half made (its `up` was interrupted): "
                        f"`tpkit cluster down --name {name}` removes it")
    return found[0]


def enter_argv(layout: Layout, i: int, cmd: list[str]) -> list[str]:
    """The command line that runs `cmd` inside host i (its network, hostname, /dev/shm,
    /etc/hosts)."""
    return ["ip", "netns", "exec", layout.host(i), "unshare", "--uts", "--mount",
            "--propagation", "private", "--", "sh", "-c", _ENTER, layout.host(i),
            str(layout.shm_dir(i)), str(layout.hosts_file(i)), *cmd]


def run(name: str, host: str, cmd: list[str]) -> None:
    """Become `cmd` inside host `host` of cluster `name` (exec: signals reach it)."""
    require()
    if not cmd:
        raise UserError("nothing to run: `tpkit cluster run HOST -- COMMAND ...`")
    layout = recorded(name)
    argv = enter_argv(layout, layout.index(host), cmd)
    sys.stdout.flush()
    os.execvp(argv[0], argv)


def status_lines(layout: Layout, complete: bool) -> list[str]:
    """A cluster in words: its link, then each host's name, address, processes."""
    if not complete:
        return [f"cluster {layout.name}: half made (an interrupted up): `tpkit cluster "
                f"down --name {layout.name}` removes it"]
    link = f"links of {layout.link} each way (tbf)" if layout.link else "links unshaped"
    lines = [f"cluster {layout.name}: {layout.hosts} hosts, {link}, switch {layout.switch}"]
    present = namespaces()
    for i in range(layout.hosts):
        ns = layout.host(i)
        state = f"{len(_ip('netns', 'pids', ns).split())} processes" if ns in present \
            else "MISSING (removed by hand?)"
        lines.append(f"  {ns:<12} {layout.address(i):<12} {state}")
    return lines


def status() -> list[str]:
    """Every cluster recorded under the state directory, in words."""
    names = sorted(p.name for p in state_root().glob("*") if (p / "state.json").exists()) \
        if state_root().is_dir() else []
    lines = []
    for name in names:
        found = read_state(name)
        if found:
            lines += status_lines(*found)
    return lines or ["no cluster is up"]
