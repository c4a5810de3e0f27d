"""Preloaded by the multiprocessing forkserver that `tpkit.launch` starts: it makes the
forkserver end without the interpreter's teardown, and does nothing anywhere else.

The forkserver (torch loaded, to fork workers fast) exits when its launcher is gone,
SIGKILL included; tearing torch down then takes seconds on a busy machine, during
which a process outlives the run. Nothing of the forkserver needs that teardown: it
holds no file, semaphore or child of its own once the workers are gone (they exit
through `os._exit`, never through the exit handlers, so this one never runs in them).

Importing this module anywhere else (a test that imports every module, a user's
`import tpkit.host.forkserver_exit`) must not change how that process exits: an exit
handler that calls `os._exit(0)` would turn every failure into success. So the handler
is registered only while the forkserver's own `main` is importing its preload list,
which the call stack shows, and it still checks at exit that it runs in that process.
There, a worker forked for a launcher already gone ends quietly (`_quiet_orphan`).
"""

import atexit
import os
import sys
import traceback


def _imported_by_forkserver() -> bool:
    """True when the multiprocessing forkserver's `main` is on this import's call stack."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    main = getattr(forkserver, "main", None)
    code = getattr(main, "__code__", None)
    if code is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _exit_now(pid: int) -> None:
    """End the forkserver (process `pid`) without the interpreter's teardown."""
    if os.getpid() == pid:
        os._exit(0)


def _quiet_orphan(kind, value, tb) -> None:
    """`sys.excepthook` of the forkserver's children: a worker forked after its launcher
    had gone (a Ctrl-C while the forkserver imported torch) cannot read what the launcher
    sent (its pipe closed, its queues' semaphores unlinked) and ends without a
    traceback: the launcher already said why it stopped. Anything else as Python says it."""
    orphan = isinstance(value, (OSError, EOFError)) and any(
        f.f_code.co_name == "_main" and f.f_code.co_filename.endswith("spawn.py")
        for f, _ in traceback.walk_tb(tb))
    if not orphan:
        sys.__excepthook__(kind, value, tb)


ACTIVE = _imported_by_forkserver()  # True in the forkserver (and the workers it forks)
if ACTIVE:
    atexit.register(_exit_now, os.getpid())  # registered last, so it runs first
    sys.excepthook = _quiet_orphan
