"""End this process once its work is over and cleaned up, without the interpreter's
teardown.

With torch loaded, tearing the interpreter down (freeing every module) takes seconds
on a busy machine, time in which a process with nothing left to do still looks alive
to whoever waits for it: a shell, a supervisor, a check that no process is left. A
command stopped by a signal (`tpkit.cli`) and the quiz's web server end through here,
after their workers are killed and waited for; `Stopped` is that signal, raised to
unwind, and `quiet_stdout` silences a stdout whose reader has gone.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from typing import NoReturn

CLOSED_PIPE = 128 + signal.SIGPIPE  # the exit status of a command whose reader went away


class Stopped(KeyboardInterrupt):
    """SIGTERM, SIGHUP (or SIGINT) reached this process: unwind, stopping every child;
    the command then exits with 128 + `signum`. `said`: what the stop line adds after
    "stopped by SIGINT" (a checkpoint saved, nothing saved)."""

    def __init__(self, signum: int, said: str = "") -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.said = signum, said

    def __reduce__(self):  # from a spawned rank to its launcher
        return type(self), (self.signum, self.said)


def quiet_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone (`tpkit presets | head -1`): what
    is still buffered, and the interpreter's last flush, then go nowhere instead of
    raising BrokenPipeError again ("Exception ignored ... BrokenPipeError" at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptor: a stream in memory
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - kept open until the process ends
    finally:
        os.close(devnull)


def exit_now(status: int) -> NoReturn:
    """Run the exit handlers (multiprocessing's unlink the semaphores and join what is
    left, so nothing leaks), flush stdout and stderr, then end with `status`. Threads
    still running are not waited for."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say
            pass
    os._exit(status)
