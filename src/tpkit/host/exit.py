"""End this process once its work is over and cleaned up, without the interpreter's
teardown.

With torch loaded, tearing the interpreter down (freeing every module) takes seconds
on a busy machine, time in which a process with nothing left to do still looks alive
to whoever waits for it: a shell, a supervisor, a check that no process is left. A
command stopped by a signal (`tpkit.cli`) and the quiz's web server end through here,
after their workers are killed and waited for.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


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
