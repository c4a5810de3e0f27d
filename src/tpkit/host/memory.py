"""How much memory this machine (or its cgroup) offers, and whether the kernel killed a
process for want of it. Linux files only; None wherever they are not there.

    available()        -> (bytes, where it comes from)   the cgroup's memory.max less what
                          it uses, the machine's MemAvailable, or TPKIT_MEMORY_AVAILABLE
    oom_kills()        -> the cgroup's oom_kill count (memory.events), to compare
    peak_rss(pid)      -> VmHWM of a live process (its RSS high-water mark)

`TPKIT_MEMORY_AVAILABLE` (bytes, or with a K/M/G suffix) caps what counts as
available: to leave room for others on a shared machine (and for the tests).
"""

from __future__ import annotations

import os
from pathlib import Path

LIMIT_ENV = "TPKIT_MEMORY_AVAILABLE"
_CGROUP = Path("/sys/fs/cgroup")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def parse_bytes(text: str) -> int:
    """'6G', '512M', '1048576' -> bytes (a ValueError on anything else)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = _UNITS.get(text[-1:], 1)
    return int(float(text[:-1] if unit > 1 else text) * unit)


def _cgroups() -> tuple[Path, Path]:
    """This process's cgroup folders: (v2 unified, v1 memory controller)."""
    v2, v1 = "/", "/"
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        num, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if num == "0" and not controllers:
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    unified = _CGROUP / "unified" if (_CGROUP / "unified").is_dir() else _CGROUP
    return unified / v2.lstrip("/"), _CGROUP / "memory" / v1.lstrip("/")


def _cgroup_room() -> tuple[int, str] | None:
    """memory.max - memory.current of this process's cgroup (v2, else v1)."""
    v2, v1 = _cgroups()
    for folder, limit, usage in ((v2, "memory.max", "memory.current"),
                                 (v1, "memory.limit_in_bytes", "memory.usage_in_bytes")):
        top, used = _read(folder / limit), _read(folder / usage)
        if top and used and top != "max" and int(top) < 1 << 60:
            return max(0, int(top) - int(used)), f"cgroup {folder / limit}"
    return None


def _mem_available() -> int | None:
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def available() -> tuple[int, str] | None:
    """(bytes a new run may still use, where that number comes from), or None."""
    found: list[tuple[int, str]] = []
    if (room := _cgroup_room()) is not None:
        found.append(room)
    if (free := _mem_available()) is not None:
        found.append((free, "MemAvailable in /proc/meminfo"))
    if os.environ.get(LIMIT_ENV):
        found.append((parse_bytes(os.environ[LIMIT_ENV]), LIMIT_ENV))
    return min(found) if found else None


def oom_kills() -> int:
    """How many processes the kernel killed for memory in this cgroup (0 if unknown)."""
    v2, v1 = _cgroups()
    for events in (v2 / "memory.events", v1 / "memory.oom_control"):
        for line in (_read(events) or "").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


def peak_rss(pid: int) -> int | None:
    """The RSS high-water mark of a live process, in bytes (None once it is gone)."""
    for line in (_read(Path(f"/proc/{pid}/status")) or "").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def make_preferred_oom_victim(score: int = 500) -> None:
    """Raise this process's oom_score_adj (any process may), so that the kernel, out of
    memory, kills it rather than its launcher, which then reports the death."""
    try:
        Path("/proc/self/oom_score_adj").write_text(str(score))
    except OSError:
        pass


def gib(n: float) -> str:
    """'5.6 GiB'."""
    return f"{n / (1 << 30):.1f} GiB"
