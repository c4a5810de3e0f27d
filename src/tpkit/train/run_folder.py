"""One run per folder: `--out` checked, then locked, before anything is written into it.

    with hold(out):          # the launcher (rank 0 under torchrun), before spawning
        ...                  # the whole run

`check_writable(out)` says in one line why a path cannot be a run folder (a regular
file, a read-only mount, no permission; a folder holding files of something else than
a tpkit run; inside a checkpoint or a run's checkpoints folder, which that run's
retention would delete) before any process is spawned. `earlier_runs(out, resume)`
says (under the lock) which checkpoints there belong to another run: a new run
refuses them unless --overwrite (then they go), a resumed one always, naming both
runs (`checkpoint.retention`: a run folder belongs to one run). `hold` takes an
exclusive `flock` on `out/.tpkit-run.lock` and writes the holder (host, pid, start
time) into it; a second run into the same folder is refused with one line naming that
holder. The kernel drops a flock when its holder dies, so a lock left by a dead run
(the file still names it) is taken over, with a warning naming the dead holder. On a
clean exit the holder's record is emptied. Leftover temporaries of a save that was
killed (`.step_*.tmp`) are removed once the lock is held (`checkpoint.disk`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tpkit.checkpoint.dest import listing
from tpkit.checkpoint.disk import remove_leftovers
from tpkit.checkpoint.paths import (
    RUN_CHECKPOINTS,
    enclosing_checkpoints,
    is_checkpoint,
    run_checkpoints,
)
from tpkit.checkpoint.retention import complete, others, run_of
from tpkit.spec.errors import UserError

LOCK_FILE = ".tpkit-run.lock"
_READ_TRIES = 20  # the holder writes its record just after taking the lock


def check_writable(out: Path) -> None:
    """One UserError line when `out` cannot be a run folder; creates it when missing."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a regular file, not a folder: give a folder (created "
                        f"if missing) for metrics.jsonl, loss.png and checkpoints/")
    around = enclosing_checkpoints(out / RUN_CHECKPOINTS)  # out itself a checkpoint too
    if around is not None:
        raise UserError(f"--out {out} is or lies inside {around}: that run's retention "
                        f"would delete this run; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not is_run_folder(out):
        raise UserError(f"--out {out} holds files that are not a tpkit run's "
                        f"({listing(out)}): a run writes config.toml, metrics.jsonl and "
                        f"checkpoints/ there; choose a new or empty folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".tpkit-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"--out {out} is not writable: {os.strerror(e.errno or 0)}"
                        f"{_where(e)}; choose another --out") from None


def is_run_folder(out: Path) -> bool:
    """Whether `out` is a folder a tpkit run wrote: its lock file (every run holds one),
    or tpkit checkpoints (finished or not) in its checkpoints/."""
    folder = run_checkpoints(out)
    return (out / LOCK_FILE).is_file() or folder.is_dir() and any(
        is_checkpoint(d) or d.name.endswith(".tmp") for d in folder.iterdir())


def earlier_runs(out: Path, resume: str | None, overwrite: bool) -> list[Path]:
    """The checkpoints in `out` that another run wrote, for `--overwrite` to delete (a
    new run: every complete one); a UserError line naming both runs when they stay."""
    folder = run_checkpoints(out)
    if resume is None:
        found = complete(folder)
        if found and not overwrite:
            raise UserError(f"--out {out} holds an earlier run (checkpoints up to "
                            f"{found[-1].name}); continue it with --resume {out}, start over "
                            f"with --overwrite, or choose another --out")
        return found
    run = run_of(resume)
    found = others(folder, run)
    if found:
        (last, theirs) = found[-1]
        raise UserError(f"--out {out} holds the checkpoints of another run (run {theirs}, "
                        f"up to {last.name}); this run continues run {run or '(no id)'} from "
                        f"{resume}: resume into another --out")
    return []


def _where(e: OSError) -> str:
    return f" ({e.filename})" if e.filename else ""


def holder_of(lock: Path) -> dict | None:
    """The record of the run that holds (or last held) `lock`, or None."""
    for _ in range(_READ_TRIES):
        try:
            text = lock.read_text()
        except OSError:
            return None
        if text.strip():
            try:
                return json.loads(text)
            except ValueError:
                pass  # being written
        time.sleep(0.05)
    return None


def describe(holder: dict | None) -> str:
    """'pid 123 on host h, started 2026-12-01 09:00:00 UTC' (or that it is unknown)."""
    if not holder:
        return "a run that has not said who it is"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {started}"


@contextmanager
def hold(out: Path) -> Iterator[Path]:
    """Hold the exclusive lock of run folder `out` for the duration (call after
    `check_writable`); a UserError naming the holder when another run has it."""
    lock = out / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise UserError(f"--out {out} is in use by another run ({describe(holder_of(lock))}"
                            f"); wait for it to end, or choose another --out") from None
        left = os.read(fd, 4096).decode(errors="replace").strip()
        if left:
            previous = _parse(left)
            print(f"warning: --out {out}: taking over the lock of a run that ended without "
                  f"releasing it ({describe(previous)}, no longer running)", file=sys.stderr,
                  flush=True)
        _write(fd, json.dumps(dict(host=socket.gethostname(), pid=os.getpid(),
                                   started=time.time())))
        remove_leftovers(out)
        try:
            yield lock
        finally:
            _write(fd, "")  # released while alive: the next run has nothing to take over
    finally:
        os.close(fd)  # closing drops the flock


def _parse(text: str) -> dict | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    os.fsync(fd)
