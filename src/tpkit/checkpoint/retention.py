"""Which checkpoints of a folder are complete, and deleting the old ones safely.

    complete(run / "checkpoints")   -> [step_000100, step_000200, ...]   oldest first
    prune(run / "checkpoints", 3)   -> deletes all but the 3 newest complete ones

A checkpoint goes first to a hidden name (an atomic rename), then away, so a kill
midway never leaves a damaged checkpoint that looks complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tpkit.checkpoint.files import MANIFEST, CheckpointError, read_manifest


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoints (readable manifest) under `root`, oldest step first."""
    found = []
    for d in Path(root).iterdir() if Path(root).is_dir() else []:
        if d.is_dir() and not d.name.startswith(".") and (d / MANIFEST).is_file():
            try:
                found.append((read_manifest(d)["step"], d.name, d))
            except CheckpointError:
                continue
    return [d for _, _, d in sorted(found)]


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints under `root` (call after a
    save completed, on one rank); returns what was deleted. Each goes first to a hidden
    name (atomic), so a kill midway never leaves a damaged checkpoint that looks whole."""
    if keep < 1:
        return []
    old = complete(root)[:-keep]
    for d in old:
        discard(d)
    return old


def discard(path: Path) -> None:
    """Delete a checkpoint directory: renamed to a hidden name first (atomic), so that a
    kill midway never leaves a damaged checkpoint that looks complete."""
    aside = path.parent / f".{path.name}.deleting"
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)
