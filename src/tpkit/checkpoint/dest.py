"""Where tpkit may write a checkpoint, a full file or a Hugging Face folder, and how:
nothing it did not write is ever replaced or deleted.

    with new_artifact(dest, SHARDED, overwrite=False, sources=[src]) as tmp:
        ...write into tmp...   # a hidden sibling, renamed into place at the end
    install(tmp, dest)         # what a save does: the finished temporary takes dest's place

A destination is a new name or an empty folder; or tpkit's own artifact of the same
kind, replaced only with `overwrite` (`tpkit convert --overwrite`). What tpkit knows
as its own (`own_kind`): a sharded checkpoint (manifest.json of format
tpkit-checkpoint), a full file (safetensors metadata of format tpkit-full), a Hugging
Face export (config.json beside a model.safetensors whose metadata says tpkit wrote
it), a PEFT adapter folder (adapter_config.json beside such an
adapter_model.safetensors). Anything else that exists is refused in one line, `overwrite` or not; so is a
destination that is or lies inside its source, or holds it, or lies inside a
checkpoint or a run's folder of checkpoints (that run's retention would delete it).
A failed write removes its temporary; the destination is untouched until the rename. A
full disk, a quota or a read-only file system is one `StorageError` line naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tpkit.checkpoint.disk import writing
from tpkit.spec.errors import CheckpointError, UserError
from tpkit.weights.files import FULL_FORMAT, fsync_path, read_manifest
from tpkit.weights.hf import CONFIG_FILE, HF_WEIGHTS, written_by_tpkit
from tpkit.weights.paths import FULL, HF, PEFT, SHARDED, enclosing_checkpoints
from tpkit.weights.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tpkit.weights.slices import open_safetensors

WHAT = {SHARDED: "sharded tpkit checkpoint", FULL: "tpkit full safetensors file",
        HF: "Hugging Face folder exported by tpkit", PEFT: "PEFT adapter folder exported by tpkit"}


def own_kind(path: Path) -> str | None:
    """SHARDED, FULL or HF when `path` is that artifact as tpkit writes it, else None."""
    if path.is_file():
        try:
            meta = json.loads((open_safetensors(path).metadata() or {}).get("tpkit", "{}"))
        except (CheckpointError, ValueError):
            return None
        return FULL if isinstance(meta, dict) and meta.get("format") == FULL_FORMAT else None
    try:
        read_manifest(path)
        return SHARDED
    except CheckpointError:
        pass
    if (path / CONFIG_FILE).is_file() and written_by_tpkit(path / HF_WEIGHTS):
        return HF
    if (path / ADAPTER_CONFIG).is_file() and written_by_tpkit(path / ADAPTER_WEIGHTS):
        return PEFT
    return None


def check_dest(dest: str | Path, kind: str, *, overwrite: bool) -> None:
    """One UserError line unless what is at `dest` may become a `kind` artifact: nothing,
    an empty folder, or (`overwrite`) tpkit's own of that kind."""
    dest = Path(dest)
    if not dest.exists() and not dest.is_symlink():
        return
    if kind == FULL and dest.is_dir():
        raise UserError(f"{dest}: a folder; --to full writes one file: give a file name "
                        f"(e.g. {dest / 'model.safetensors'})")
    if dest.is_dir() and not any(dest.iterdir()):
        return  # an empty folder: nothing to lose
    mine = own_kind(dest)
    if mine == kind:
        if overwrite:
            return
        raise UserError(f"{dest}: already a {WHAT[kind]}; --overwrite replaces it")
    if mine is not None:
        raise UserError(f"{dest}: a {WHAT[mine]}, not a {WHAT[kind]}: not replaced, "
                        f"--overwrite or not; choose another destination")
    held = "a file" if not dest.is_dir() else f"a folder holding {listing(dest)}"
    raise UserError(f"{dest}: exists, {held}, and is not a {WHAT[kind]}: nothing there is "
                    f"replaced, --overwrite or not; choose a new name or an empty folder")


def check_not_nested(dest: Path, sources: Iterable[str | Path]) -> None:
    """One UserError line when `dest` is, lies inside or holds one of `sources`, or lies
    inside a checkpoint or a run's folder of checkpoints."""
    where = dest.resolve()
    for source in sources:
        src = Path(source).resolve()
        if where == src or src in where.parents:
            raise UserError(f"{dest}: is or lies inside the source {source}: write it "
                            f"outside the source")
        if where in src.parents:
            raise UserError(f"{dest}: holds the source {source}: write it outside the source")
    held = enclosing_checkpoints(dest)
    if held is not None:
        raise UserError(f"{dest}: lies inside {held}: a checkpoint holds only its own files, "
                        f"and a run's retention deletes what its checkpoints folder holds; "
                        f"write it elsewhere")


def listing(folder: Path, most: int = 3) -> str:
    """'a/, b.txt, c.txt, ... (7 entries)': what a folder holds, for an error line."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    more = f", ... ({len(names)} entries)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def temporary(dest: Path) -> Path:
    """The hidden sibling a write of `dest` goes to first."""
    return dest.parent / f".{dest.name}.tmp"


@contextmanager
def new_artifact(dest: str | Path, kind: str, *, overwrite: bool = False,
                 sources: Iterable[str | Path] = ()) -> Iterator[Path]:
    """Check `dest` (`check_not_nested`, `check_dest`), yield its temporary (a folder,
    or for FULL a file name) to write, then rename it into place; on any error remove
    the temporary."""
    dest = Path(dest)
    check_not_nested(dest, sources)
    check_dest(dest, kind, overwrite=overwrite)
    tmp = temporary(dest)
    remove(tmp)
    try:
        with writing(dest):  # a full or read-only disk: one line naming dest
            dest.parent.mkdir(parents=True, exist_ok=True)
            if kind != FULL:
                tmp.mkdir()
            yield tmp
            install(tmp, dest)
    except BaseException:
        remove(tmp)
        raise


def install(tmp: Path, dest: Path) -> None:
    """Rename the finished `tmp` to `dest`: a file atomically; a folder replacing the one
    there (checked to be replaceable) only now, through a hidden `.NAME.old` aside (a
    kill between the two renames leaves it, which `paths.locate` still reads)."""
    if tmp.is_file():
        os.replace(tmp, dest)
        fsync_path(dest.parent)
        return
    aside = dest.parent / f".{dest.name}.old"
    remove(aside)
    if dest.exists():
        os.rename(dest, aside)
    os.rename(tmp, dest)
    fsync_path(dest.parent)
    remove(aside)


def remove(path: Path) -> None:
    """Delete a temporary of tpkit's (a file or a folder), if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
