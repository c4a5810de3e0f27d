"""Storage errors said once, and the temporaries of interrupted saves swept away.

    with writing(path, nbytes):      # around every write of a checkpoint or a run file
        save_file(...)

A full disk (ENOSPC), a quota (EDQUOT), a read-only file system (EROFS) or a refused
permission (EACCES, EPERM) while writing becomes one `StorageError` line naming the
file, the bytes being written and the free space there:

    runs/a/checkpoints/.step_000004.tmp/model-tp00-pp00.safetensors: No space left on
    device while writing 898,816 bytes (free there: 12,288 bytes)

It is a `RunFailed` (exit 1: the run failed, the user made no mistake). safetensors
reports an I/O error as text ("... (os error 28)"), read back into its errno here.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tpkit.spec.errors import RunFailed
from tpkit.weights.paths import RUN_CHECKPOINTS

STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
LEFTOVER_SUFFIXES = (".tmp", ".deleting")  # hidden `.step_N.tmp`: a save that was killed
_OS_ERROR = re.compile(r"os error (\d+)")


class StorageError(RunFailed):
    """A write failed for lack of space or permission: one line, exit 1."""


def error_number(e: BaseException) -> int | None:
    """The errno of an OSError, or of an I/O error safetensors reported as text."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    found = _OS_ERROR.search(str(e))
    return int(found.group(1)) if found else None


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding `path`."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def as_storage_error(e: BaseException, path: Path, nbytes: int | None) -> StorageError | None:
    """The one-line StorageError for `e` while writing `path`, or None (another error)."""
    if isinstance(e, StorageError):
        return e
    code = error_number(e)
    if code not in STORAGE_ERRNOS:
        return None
    size = f" while writing {nbytes:,} bytes" if nbytes is not None else " while writing"
    free = free_bytes(path)
    room = f" (free there: {free:,} bytes)" if free is not None else ""
    return StorageError(f"{path}: {os.strerror(code)}{size}{room}")


@contextmanager
def writing(path: Path, nbytes: int | None = None) -> Iterator[None]:
    """Turn a storage error raised inside into one `StorageError` line naming `path`."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised as is unless it is a storage error
        said = as_storage_error(e, path, nbytes)
        if said is None:
            raise
        raise said from None


def remove_leftovers(run_dir: Path) -> list[Path]:
    """Delete the hidden temporaries (`.step_N.tmp`, `.step_N.deleting`) that a killed or
    failed save left in `run_dir/checkpoints`; call with the run folder locked."""
    folder = run_dir / RUN_CHECKPOINTS
    gone = [d for d in (sorted(folder.iterdir()) if folder.is_dir() else [])
            if d.name.startswith(".") and d.name.endswith(LEFTOVER_SUFFIXES) and d.is_dir()]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    if gone:
        print(f"note: removed {len(gone)} leftover temporary folder(s) of an interrupted "
              f"save: {', '.join(d.name for d in gone)}", file=sys.stderr, flush=True)
    return gone
