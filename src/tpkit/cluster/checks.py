"""What making simulated hosts needs, checked before anything is made: one line naming
what is missing (capabilities, programs, kernel namespaces)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tpkit.spec.errors import UserError

# Linux capability bits (linux/capability.h): namespaces and mounts, links and qdiscs
CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}
PROGRAMS = {"ip": "iproute2", "tc": "iproute2", "unshare": "util-linux"}
NAMESPACES = ("net", "uts", "mnt")


def effective_capabilities() -> int:
    """This process's effective capability mask (0 if /proc says nothing)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def missing() -> str | None:
    """What this process lacks to make hosts, in words; None if nothing."""
    caps = effective_capabilities()
    lacking = [name for name, bit in CAPABILITIES.items() if not caps >> bit & 1]
    if lacking:
        return (f"making hosts needs root ({' and '.join(lacking)} missing: this process "
                f"runs as uid {os.geteuid()})")
    absent = [f"{p} ({pkg})" for p, pkg in PROGRAMS.items() if shutil.which(p) is None]
    if absent:
        return f"making hosts needs the programs {', '.join(absent)}; not found on PATH"
    kinds = [k for k in NAMESPACES if not Path(f"/proc/self/ns/{k}").exists()]
    if kinds:
        return f"this kernel has no {', '.join(kinds)} namespaces (/proc/self/ns)"
    return None


def require() -> None:
    """A UserError naming what is missing, if anything is."""
    why = missing()
    if why:
        raise UserError(why)
