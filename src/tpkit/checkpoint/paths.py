"""What a path names, for every command alike: a sharded checkpoint, a run folder, one
full safetensors file, or a Hugging Face directory.

    locate("runs/demo")              -> sharded, runs/demo/checkpoints/step_000400
    locate("runs/demo/checkpoints")  -> the same (a folder of checkpoints)
    locate("ckpt-dir")               -> sharded, itself (it has manifest.json)
    locate("model.safetensors")      -> full
    locate("hf-dir")                 -> hf (it has config.json)

A run folder (the `--out` of `tpkit train`) holds `checkpoints/step_*`. The newest
VALID checkpoint in it is used: its manifest reads and every file it lists is there
with its recorded size. A newer one that is not valid (manifest gone or unreadable, a
truncated or missing shard) is skipped with a `CheckpointWarning` naming it and why (a
save in progress, or killed, is a hidden `.step_*.tmp` and never a candidate). Checksums are checked when the files are read (`files.verify_file`), not here:
hashing a whole checkpoint to choose it would read it twice.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from tpkit.checkpoint.files import (
    MANIFEST,
    CheckpointError,
    rank_file,
    read_manifest,
    size_problem,
)
from tpkit.checkpoint.hf import CONFIG_FILE

RUN_CHECKPOINTS = "checkpoints"  # the folder of checkpoints inside a run folder
SHARDED, FULL, HF = "sharded", "full", "hf"


class CheckpointWarning(UserWarning):
    """A newer checkpoint in a run folder was skipped because it is damaged."""


@dataclass(frozen=True)
class Located:
    """A path resolved to what it holds: `kind` is SHARDED, FULL or HF."""

    kind: str
    path: Path


def run_checkpoints(run_dir: str | Path) -> Path:
    """The folder of checkpoints of the run `tpkit train --out run_dir` writes."""
    return Path(run_dir) / RUN_CHECKPOINTS


def step_dir(run_dir: str | Path, step: int) -> Path:
    """Where `tpkit train --out run_dir` writes its checkpoint of `step`."""
    return run_checkpoints(run_dir) / f"step_{step:06d}"


def locate(path: str | Path) -> Located:
    """What `path` is (a run folder becomes its latest valid checkpoint), or one
    CheckpointError line saying why it is none of them."""
    path = Path(path)
    aside = path.parent / f".{path.name}.old"  # a save killed between its two renames
    if not path.exists() and (aside / MANIFEST).is_file():
        return Located(SHARDED, aside)
    if _is_checkpoint(path):
        return Located(SHARDED, path)
    if path.is_file():
        return Located(FULL, path)
    if (path / CONFIG_FILE).is_file():
        return Located(HF, path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    newest = _run_latest(path)
    if newest is not None:
        return Located(SHARDED, newest)
    raise CheckpointError(f"{path}: not a checkpoint: neither a tpkit checkpoint "
                          f"({MANIFEST}), a run folder ({RUN_CHECKPOINTS}/step_*), a full "
                          f".safetensors file, nor a Hugging Face directory ({CONFIG_FILE})")


def sharded_dir(path: str | Path) -> Path:
    """The sharded checkpoint directory `path` means (itself, or a run folder's latest
    valid checkpoint); a full file or a Hugging Face directory is refused: it has no
    optimizer state and no layout."""
    found = locate(path)
    if found.kind != SHARDED:
        what = "a full safetensors file" if found.kind == FULL else "a Hugging Face directory"
        raise CheckpointError(f"{path}: {what}, not a sharded tpkit checkpoint "
                              f"(`tpkit convert {path} DEST --to sharded` makes one)")
    return found.path


def latest(root: str | Path) -> Path | None:
    """The newest valid checkpoint under `root` (a run folder or a folder of checkpoints),
    warning about newer damaged ones; None when there is no valid one."""
    return _newest_valid(_candidates(Path(root)))


def _run_latest(root: Path) -> Path | None:
    """The latest valid checkpoint of a run folder; None when `root` holds no checkpoint
    at all, a CheckpointError when it holds only damaged ones."""
    candidates = _candidates(root)
    if not candidates:
        return None
    found = _newest_valid(candidates)
    if found is None:
        why = "; ".join(f"{d.name}: {p}" for _, d, p in candidates)
        raise CheckpointError(f"{root}: no valid checkpoint in this run folder ({why})")
    return found


def _newest_valid(candidates: list) -> Path | None:
    """The newest valid one of `_candidates`' list, warning about newer damaged ones."""
    ranked = sorted(candidates, key=lambda c: c[0], reverse=True)
    for i, (_, d, problem) in enumerate(ranked):
        if problem is None:
            for _, bad, why in ranked[:i]:
                warnings.warn(f"{bad}: skipped, damaged ({why}); using {d}",
                              CheckpointWarning, stacklevel=3)
            return d
    return None


def _candidates(root: Path) -> list[tuple[tuple[int, str], Path, str | None]]:
    """((step, name), dir, problem or None) of every checkpoint directory, valid or not,
    in `root` or `root/checkpoints` (hidden ones are a save in progress)."""
    out = []
    for folder in (root, root / RUN_CHECKPOINTS):
        for d in sorted(folder.iterdir()) if folder.is_dir() else []:
            if not d.name.startswith(".") and _is_checkpoint(d):
                step, problem = _check(d)
                out.append(((step, d.name), d, problem))
    return out


def _is_checkpoint(d: Path) -> bool:
    """A directory a save wrote (complete or not): it has a manifest or rank 0's record."""
    return (d / MANIFEST).is_file() or (d / rank_file(0)).is_file()


def _check(d: Path) -> tuple[int, str | None]:
    """(step, why the checkpoint in `d` is not valid or None), without checksums."""
    digits = re.findall(r"\d+", d.name)
    try:
        manifest = read_manifest(d)
    except CheckpointError as e:
        return (int(digits[-1]) if digits else -1), str(e).removeprefix(f"{d}/")
    problems = [p for name, entry in manifest["files"].items()
                if (p := size_problem(d, name, entry))]
    return manifest["step"], (problems[0].removeprefix(f"{d}/") if problems else None)
