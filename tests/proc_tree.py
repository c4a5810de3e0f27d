"""Processes under a pid, read from /proc (Linux): for the shutdown tests."""

from __future__ import annotations

import os
import signal
import time

# `sh -c PAUSE_WHILE_FLAG FLAG python -m tpkit train ...` (torchrun --no-python): each
# worker started while FLAG exists pauses 1 s after every checkpoint file it writes, so
# a kill after the first checkpoint still lands mid-run; workers restarted after the
# test removed FLAG run at full speed.
PAUSE_WHILE_FLAG = 'if [ -e "$0" ]; then export TPKIT_CKPT_PAUSE_S=1; fi; exec "$@"'


def _parents() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    out[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), now."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill(pids: list[int]) -> None:
    """SIGKILL each pid still running (one that ended meanwhile is no error)."""
    for p in pids:
        if running(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_gone(pids: list[int], timeout: float) -> tuple[float, list[int]]:
    """Seconds until every pid stopped (or `timeout`), and the ones still running."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        left = [p for p in pids if running(p)]
        if not left:
            return time.monotonic() - t0, []
        time.sleep(0.05)
    return time.monotonic() - t0, [p for p in pids if running(p)]


def cmdline(pid: int) -> str:
    """The command line of `pid` ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def workers(launcher: int) -> list[int]:
    """The spawned ranks of a tpkit launcher, in rank (start) order: the forkserver's
    children."""
    servers = [p for p in descendants(launcher) if "forkserver" in cmdline(p)]
    children = {c for s in servers for c in descendants(s)}
    return sorted(c for c in children if any(c in descendants(s) for s in servers)
                  and _parent(c) in servers)


def _parent(pid: int) -> int:
    return _parents().get(pid, -1)
