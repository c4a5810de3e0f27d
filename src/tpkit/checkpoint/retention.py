"""Which checkpoints of a folder are complete, whose run they are, and deleting the old
ones safely.

    complete(run / "checkpoints")          -> [step_000100, step_000200, ...]  oldest first
    run_of(step_000200)                    -> "3f9c0a1b2d4e"   the run that wrote it
    prune(run / "checkpoints", 3, run="3f9c0a1b2d4e", current=step_000300)

A run folder belongs to one training run: its id (`new_run_id`, at a fresh start;
kept on resume) is in the manifest of every checkpoint it writes. A manifest without
one (written before run ids existed) counts as the run of the folder it lies in: the
id of the newest checkpoint beside it that has one, else no id at all, which no run
ever conflicts with. Retention deletes only its own run's checkpoints, never the one
just written. A checkpoint goes first to a hidden name (an atomic rename), then away,
so a kill midway never leaves a damaged checkpoint that looks complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from tpkit.checkpoint.files import MANIFEST, CheckpointError, read_manifest


def new_run_id() -> str:
    """The id of a training run started fresh."""
    return uuid.uuid4().hex[:12]


def _manifests(root: str | Path) -> list[tuple[dict, Path]]:
    """(manifest, dir) of the complete checkpoints under `root`, oldest step first."""
    found = []
    for d in Path(root).iterdir() if Path(root).is_dir() else []:
        if d.is_dir() and not d.name.startswith(".") and (d / MANIFEST).is_file():
            try:
                found.append((read_manifest(d), d))
            except CheckpointError:
                continue
    return sorted(found, key=lambda md: (md[0]["step"], md[1].name))


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoints (readable manifest) under `root`, oldest step first."""
    return [d for _, d in _manifests(root)]


def run_of(checkpoint: str | Path) -> str | None:
    """The id of the run that wrote `checkpoint`; for a manifest without one, the run
    of the folder it lies in (the newest id beside it), else None."""
    checkpoint = Path(checkpoint)
    own = read_manifest(checkpoint).get("run")
    if own is not None:
        return own
    ids = [m["run"] for m, _ in _manifests(checkpoint.parent) if m.get("run")]
    return ids[-1] if ids else None


def others(root: str | Path, run: str | None) -> list[tuple[Path, str]]:
    """(checkpoint, its run) of the complete checkpoints under `root` that another run
    wrote (those without an id are the folder's run: never another's)."""
    return [(d, m["run"]) for m, d in _manifests(root) if m.get("run") not in (None, run)]


def prune(root: str | Path, keep: int, *, run: str | None = None,
          current: str | Path | None = None) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints of run `run` (None: of
    every run) under `root`; call after the save of `current` completed, on one rank.
    `current` is always kept; this run's checkpoints of a later step (an abandoned
    continuation: the run resumed from an earlier one, or past a damaged one) go too.
    Returns what was deleted."""
    if keep < 1:
        return []
    mine = [(m["step"], d) for m, d in _manifests(root)
            if run is None or m.get("run") in (None, run)]
    cur = Path(current) if current is not None else None
    now = read_manifest(cur)["step"] if cur is not None else None
    later = [d for step, d in mine if d != cur and now is not None and step > now]
    rest = [d for step, d in mine if d != cur and (now is None or step <= now)]
    kept = keep - (cur is not None)  # the newest others kept beside `current`
    old = later + (rest[:-kept] if kept else rest)
    for d in old:
        discard(d)
    return old


def discard(path: Path) -> None:
    """Delete a checkpoint directory: renamed to a hidden name first (atomic), so that a
    kill midway never leaves a damaged checkpoint that looks complete."""
    aside = path.parent / f".{path.name}.deleting"
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)
