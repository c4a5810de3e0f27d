"""Names of the shared-memory segments, and the sweep that removes a run's leftovers.

    /dev/shm/tpkit-<host>-<run>-<incarnation>-<group><ranks>-<nonce>
    e.g.     tpkit-node1-3f9a2c1b-0-tp0_1-5d2e9a

The host, the run identifier (TPKIT_RUN_ID: drawn per worker pool by `tpkit.launch`,
after the launcher's own TPKIT_RUN_ID if it has one; else torchrun's run id) and the incarnation (restarts) keep two runs, two groups or a
restarted run off one another's memory; the nonce makes the name unique even for two
meshes over the same ranks. Segments are unlinked once every rank has mapped them, so
this sweep only matters for a rank (or launcher) killed during the few milliseconds of
set-up: the launcher runs it when it stops its workers, a worker when its launcher died.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "tpkit-"


def _clean(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", text)[:limit] or "x"


def run_id() -> str:
    """This run's identifier, the same on every rank of it."""
    return _clean(os.environ.get("TPKIT_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
                  or "run", 40)


def segment_name(group: str, ranks: tuple[int, ...], incarnation: str) -> str:
    """A fresh name for one group's segment (drawn by the group's first rank)."""
    members = "_".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}-{ranks[-1]}"
    return (f"/{PREFIX}{_clean(socket.gethostname(), 32)}-{run_id()}-"
            f"{_clean(incarnation, 16)}-{_clean(group, 16)}{members}-{uuid.uuid4().hex[:6]}")


def remove_segments(run: str | None) -> list[str]:
    """Unlink every segment of run `run` on this host; the names removed."""
    if not run or not SHM_DIR.is_dir():
        return []
    host = _clean(socket.gethostname(), 32)
    gone = []
    for path in SHM_DIR.glob(f"{PREFIX}{host}-{_clean(run, 40)}-*"):
        try:
            path.unlink()
            gone.append(path.name)
        except OSError:
            pass
    return gone
