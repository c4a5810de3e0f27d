"""What a path names, for every command alike: a sharded checkpoint, a run folder, one
full safetensors file, or a Hugging Face directory.

    locate("runs/demo")              -> sharded, runs/demo/checkpoints/step_000400
    locate("runs/demo/checkpoints")  -> the same (a folder of checkpoints)
    locate("ckpt-dir")               -> sharded, itself (it has manifest.json)
    locate("model.safetensors")      -> full
    locate("hf-dir")                 -> hf (it has config.json)

A run folder (the `--out` of `tpkit train`) holds `checkpoints/step_*`. The newest
VALID checkpoint in it is used: its manifest reads and every file it lists is there
with its recorded size and, when an older valid one is left to fall back to, its
sha256. A newer one that is not valid (manifest gone or unreadable, a truncated or
missing shard, a flipped byte) is skipped with a `CheckpointWarning` naming it, why,
and the checkpoint used (a save in progress, or killed, is a hidden `.step_*.tmp` and
never a candidate). The checksums are those the reader checks anyway
(`files.verify_file`): hashed once per process, in parallel threads, and not again
when the ranks read the files (an open source carries what was hashed). Only the
files its reader needs are hashed: a weights reader (`locate`) skips the optimizer
shards, a resumed run (`sharded_dir`, `latest`) does not. The last candidate is not
hashed here: with nothing to fall back to, its reader says what is wrong with it.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from tpkit.spec.errors import CheckpointError, CheckpointWarning
from tpkit.weights.files import (
    MANIFEST,
    first_mismatch,
    is_optim_file,
    rank_file,
    read_manifest,
    size_problem,
)
from tpkit.weights.hf import CONFIG_FILE

RUN_CHECKPOINTS = "checkpoints"  # the folder of checkpoints inside a run folder
SHARDED, FULL, HF = "sharded", "full", "hf"
PEFT = "peft"  # a LoRA adapter folder as PEFT reads it (`tpkit.weights.peft`)


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


def locate(path: str | Path, *, optimizer: bool = False) -> Located:
    """What `path` is (a run folder becomes its latest valid checkpoint: its optimizer
    shards checked too with `optimizer`), or one CheckpointError line saying why it is
    none of them."""
    path = Path(path)
    aside = path.parent / f".{path.name}.old"  # a save killed between its two renames
    if not path.exists() and (aside / MANIFEST).is_file():
        return Located(SHARDED, aside)
    if is_checkpoint(path):
        return Located(SHARDED, path)
    if path.is_file():
        return Located(FULL, path)
    if (path / CONFIG_FILE).is_file():
        return Located(HF, path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    newest = _run_latest(path, optimizer)
    if newest is not None:
        return Located(SHARDED, newest)
    raise CheckpointError(f"{path}: not a checkpoint: neither a tpkit checkpoint "
                          f"({MANIFEST}), a run folder ({RUN_CHECKPOINTS}/step_*), a full "
                          f".safetensors file, nor a Hugging Face directory ({CONFIG_FILE})")


def enclosing_checkpoints(path: str | Path) -> str | None:
    """'the checkpoint X' or 'the checkpoints folder X' that `path` lies strictly inside
    (X holds a checkpoint: a run's retention there deletes what is not its own), or None."""
    for up in Path(path).resolve().parents:
        if is_checkpoint(up):
            return f"the checkpoint {up}"
        if up.name == RUN_CHECKPOINTS and any(is_checkpoint(d) for d in up.iterdir()):
            return f"the checkpoints folder {up}"
    return None


def sharded_dir(path: str | Path) -> Path:
    """The sharded checkpoint directory `path` means (itself, or a run folder's latest
    valid checkpoint); a full file or a Hugging Face directory is refused: it has no
    optimizer state and no layout."""
    found = locate(path, optimizer=True)
    if found.kind != SHARDED:
        what = "a full safetensors file" if found.kind == FULL else "a Hugging Face directory"
        raise CheckpointError(f"{path}: {what}, not a sharded tpkit checkpoint "
                              f"(`tpkit convert {path} DEST --to sharded` makes one)")
    return found.path


def latest(root: str | Path) -> Path | None:
    """The newest valid checkpoint under `root` (a run folder or a folder of checkpoints),
    warning about newer damaged ones; None when there is no checkpoint at all, a
    CheckpointError when there are only damaged ones (a run resumed from nothing would
    start over beside them)."""
    return _run_latest(Path(root), optimizer=True)


def newest_whole(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` whose manifest reads and whose files have their
    sizes (no checksums: quick, for a line that names it), or None."""
    whole = [(rank, d) for rank, d, problem in _candidates(Path(root)) if problem is None]
    return max(whole)[1] if whole else None


def _run_latest(root: Path, optimizer: bool) -> Path | None:
    """The latest valid checkpoint of a run folder; None when `root` holds no checkpoint
    at all, a CheckpointError when it holds only damaged ones."""
    candidates = _candidates(root)
    if not candidates:
        return None
    found, skipped = _newest_valid(candidates, optimizer)
    if found is None:
        why = "; ".join(f"{d.name}: {p}" for d, p in skipped)
        raise CheckpointError(f"{root}: no valid checkpoint in this run folder ({why})")
    for bad, why in skipped:
        warnings.warn(f"{bad}: skipped, damaged ({why}); using {found}", CheckpointWarning,
                      stacklevel=3)
    return found


def _newest_valid(candidates: list, optimizer: bool) -> tuple[Path | None, list]:
    """(the newest valid one of `_candidates`' list or None, [(newer damaged one, why)]).
    A whole-looking one is hashed (the files its reader needs) only while an older
    whole-looking one is left to fall back to."""
    ranked = sorted(candidates, key=lambda c: c[0], reverse=True)
    left = sum(problem is None for _, _, problem in ranked)
    skipped = []
    for _, d, problem in ranked:
        if problem is None:
            left -= 1
            problem = _checksum_problem(d, optimizer) if left else None
        if problem is None:
            return d, skipped
        skipped.append((d, problem))
    return None, skipped


def _checksum_problem(d: Path, optimizer: bool) -> str | None:
    """Why a file the reader of checkpoint `d` needs does not match its sha256, or None."""
    try:
        manifest = read_manifest(d)
    except CheckpointError as e:  # deleted meanwhile (pruned by a run still saving)
        return str(e).removeprefix(f"{d}/")
    names = [n for n in manifest["files"] if optimizer or not is_optim_file(n)]
    problem = first_mismatch(d, manifest, names)
    return problem and problem.removeprefix(f"{d}/")


def _candidates(root: Path) -> list[tuple[tuple[int, str], Path, str | None]]:
    """((step, name), dir, problem or None) of every checkpoint directory, valid or not,
    in `root` or `root/checkpoints` (hidden ones are a save in progress)."""
    out = []
    for folder in (root, root / RUN_CHECKPOINTS):
        for d in sorted(folder.iterdir()) if folder.is_dir() else []:
            if not d.name.startswith(".") and is_checkpoint(d):
                step, problem = _check(d)
                out.append(((step, d.name), d, problem))
    return out


def is_checkpoint(d: Path) -> bool:
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
