"""A stop asked for by a signal, honoured at the next safe point instead of at once:
`tpkit train` finishes its step, checkpoints, then exits 128 + the signal.

    with honoured():          # a rank's main thread, around its run
        ... asked()           # the first SIGINT/SIGTERM's number, or 0
    with passed_on(fwd):      # a launcher: its first SIGINT/SIGTERM goes to its ranks

Who acts on a second signal: a process that runs the ranks itself (one rank, or a rank
under torchrun, whose agent forwards each signal it gets, once) stops at once, raising
`Stopped`; a worker a tpkit launcher spawned ignores it (`launcher_decides`): the
terminal sends every Ctrl-C to the launcher and its workers alike, and the launcher
forwards its first one too, so a worker may see one stop twice; the launcher acts on
its own second signal by killing them. Torch-free (`tpkit.cli` uses it).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tpkit.host.exit import Stopped

HONOURED = (signal.SIGINT, signal.SIGTERM)  # SIGHUP (a closed terminal) stops at once
AGAIN = " again, at once: nothing saved"  # what a second signal's stop line says

_state = {"asked": 0, "launcher_decides": False, "forward": None}


def asked() -> int:
    """The number of the first stop signal this process got (0: none)."""
    return _state["asked"]


def ask(signum: int) -> bool:
    """Record a stop signal; True when it is the first."""
    first = not _state["asked"]
    if first:
        _state["asked"] = signum
    return first


def forget() -> None:
    """No stop asked: a spawned worker's next task starts afresh."""
    _state["asked"] = 0


def launcher_decides() -> None:
    """This process is a spawned worker: record every SIGINT, quietly, from now on (its
    launcher stops it: no KeyboardInterrupt, no traceback), and leave a second signal
    to the launcher."""
    _state["launcher_decides"] = True
    signal.signal(signal.SIGINT, lambda signum, _frame: ask(signum))


@contextmanager
def honoured() -> Iterator[None]:
    """Inside, in the main thread: the first SIGINT/SIGTERM is recorded (`asked`), for the
    caller to act on at its next safe point; a second raises `Stopped` at once, unless
    the launcher decides (`launcher_decides`). Elsewhere (another thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, _frame):
        if ask(signum) or _state["launcher_decides"]:
            return
        for s in HONOURED:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum, AGAIN)

    previous = {s: signal.signal(s, on_signal) for s in HONOURED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def passed_on(forward: Callable[[int], bool]) -> Iterator[None]:
    """Inside, a launcher's first SIGINT/SIGTERM goes to its ranks: `forward(signum)`
    sends it, False when there is no rank to send it to (`pass_on`)."""
    _state["forward"] = forward
    try:
        yield
    finally:
        _state["forward"] = None


def pass_on(signum: int) -> bool:
    """For the command's signal handler: True when this first SIGINT/SIGTERM was passed
    on to the ranks (the command goes on, waiting for them); False: stop now."""
    forward = _state["forward"]
    if signum not in HONOURED or forward is None or asked():
        return False
    if not forward(signum):
        return False
    return ask(signum)
