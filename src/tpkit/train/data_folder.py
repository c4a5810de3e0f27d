"""Where `tpkit prepare-data` writes: a folder that is complete, or as it was.

    data/                          --out: locked (`run_folder.hold`, the lock of a run
                                   folder) for the whole run, then swapped with
    .data.tpkit-prepare-1234/      the sibling the shards and index.json are written into

`replacing(out, overwrite)` yields the empty sibling; when the body returns, the two
folders are exchanged in one rename (`renameat2(RENAME_EXCHANGE)`; two renames where
the file system has no exchange) and the old contents are removed. A failure or a
signal removes the sibling: --out is left as it was. A killed run leaves only a hidden
sibling, which the next run into the same --out removes (holding its lock, no other
run can be using it).

Before anything is written, --out must be new, empty, or a folder of tpkit's prepared
data (index.json, shards, the lock: `OWN`); replacing prepared data takes --overwrite,
as replacing a run's checkpoints does in `tpkit train`. Anything else is refused, and
only files of tpkit's names are ever deleted.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tpkit.checkpoint.disk import writing
from tpkit.spec.errors import UserError
from tpkit.train.run_folder import LOCK_FILE, check_writable, hold
from tpkit.train.tokens import INDEX, index_problems

OWN = re.compile(r"(index\.json|(shard|mask)_\d{5}\.bin|\.(index\.json|(shard|mask)_\d{5}\.bin)\.tmp|"
                 + re.escape(LOCK_FILE) + r"|\.tpkit-write-probe-\d+)")
_RENAME_EXCHANGE = 2  # linux/fs.h
_SHOWN = 4  # foreign names quoted in a refusal


def sibling(out: Path, what: str = "prepare") -> Path:
    """The hidden folder next to `out` that this process writes into (or sets aside)."""
    return out.parent / f".{out.name}.tpkit-{what}-{os.getpid()}"


@contextmanager
def replacing(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """An empty folder to write the new contents of `out` into, swapped into place when
    the body returns (see the module); UserError lines for an --out that cannot be."""
    out = out.resolve()  # `.`, `..`, a symlink: the folder it names is replaced
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a regular file, not a folder: give a folder "
                        f"(created if missing) for the shards and index.json")
    if out.is_dir():
        check_destination(out, overwrite)  # before a lock file is added (again once locked)
    created, swapped = _make(out), False
    check_writable(out)
    with hold(out):
        try:
            check_destination(out, overwrite)
            remove_leftovers(out)
            new = _fresh(sibling(out), out)
            try:
                with hold(new), writing(out):  # after the swap, --out's lock is this one
                    yield new
                    _swap(new, out)
                    swapped = True
            finally:
                remove_own(new)  # the unfinished folder, or (swapped) the old contents
        finally:
            if created and not swapped:  # made by this run, it holds only its lock: gone
                remove_own(out, quiet=True)


def _make(out: Path) -> bool:
    """Create `out`; True when this call did (not another run, nor an earlier one)."""
    try:
        out.mkdir(parents=True)
        return True
    except OSError:  # there already, or not creatable (`check_writable` says why)
        return False


def _fresh(new: Path, out: Path) -> Path:
    try:
        new.mkdir()
    except OSError as e:
        raise UserError(f"--out {out}: cannot write next to it ({new}: "
                        f"{os.strerror(e.errno or 0)}); choose another --out") from None
    return new


def check_destination(out: Path, overwrite: bool) -> None:
    """--out is empty, or tpkit's prepared data and `overwrite`; else one UserError line."""
    names = sorted(e.name for e in out.iterdir() if e.name != LOCK_FILE)
    if not names:
        return
    foreign = [n for n in names if not OWN.fullmatch(n)]
    if foreign:
        shown = ", ".join(foreign[:_SHOWN]) + (", ..." if len(foreign) > _SHOWN else "")
        raise UserError(f"--out {out} is not empty and holds files prepare-data did not write "
                        f"({len(foreign)}: {shown}); choose a new or empty --out")
    if overwrite:
        return
    raise UserError(f"--out {out} holds {_describe(out)}; replace it with --overwrite, or "
                    f"choose another --out")


def _describe(out: Path) -> str:
    try:
        index = json.loads((out / INDEX).read_text())
    except (OSError, ValueError):
        return "token shards without a valid index.json (an interrupted prepare-data)"
    if index_problems(index):
        return "token shards without a valid index.json (an interrupted prepare-data)"
    sources = ", ".join(map(str, index.get("sources", []))) or "unknown sources"
    return (f"data prepared earlier ({index.get('documents', '?'):,} documents, "
            f"{index['tokens']:,} tokens of {sources})")


def remove_leftovers(out: Path) -> list[Path]:
    """Delete the siblings that earlier runs into `out` left when killed (call with `out`
    locked: no live run writes them); only files of tpkit's names go."""
    pattern = re.compile(re.escape(f".{out.name}.tpkit-") + r"(prepare|aside)-\d+")
    gone = [d for d in sorted(out.parent.iterdir()) if pattern.fullmatch(d.name)
            and d.is_dir() and not d.is_symlink()]
    for d in gone:
        remove_own(d)
    if gone:
        print(f"note: removed {len(gone)} leftover folder(s) of an interrupted prepare-data: "
              f"{', '.join(d.name for d in gone)}", file=sys.stderr, flush=True)
    return gone


def remove_own(folder: Path, quiet: bool = False) -> None:
    """Delete the files of tpkit's names in `folder`, then the folder if that empties it;
    anything else stays (and is named, unless `quiet`)."""
    if not folder.is_dir():
        return
    kept = []
    for entry in folder.iterdir():
        if OWN.fullmatch(entry.name) and entry.is_file() and not entry.is_symlink():
            entry.unlink(missing_ok=True)
        else:
            kept.append(entry.name)
    if kept:
        if not quiet:
            print(f"warning: kept {folder}: it holds files tpkit did not write "
                  f"({', '.join(sorted(kept)[:_SHOWN])})", file=sys.stderr, flush=True)
        return
    try:
        folder.rmdir()
    except OSError:
        pass  # something appeared meanwhile: it stays


def _swap(new: Path, out: Path) -> None:
    """Exchange the folders `new` and `out` (then `new` holds the old contents)."""
    try:
        _exchange(new, out)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
            raise
        aside = sibling(out, "aside")  # no exchange here: two renames
        out.rename(aside)
        new.rename(out)
        aside.rename(new)


def _exchange(a: Path, b: Path) -> None:
    """renameat2(a, b, RENAME_EXCHANGE): both paths swapped in one step (Linux >= 3.15);
    an OSError (ENOSYS where libc or the kernel lacks it, EINVAL where the file system
    does)."""
    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "renameat2", None)
    if call is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd = -100
    if call(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))
