"""The multiprocessing forkserver every tpkit worker process is forked from: torch, and
what a command's ranks all import, loaded there once before it forks them.

    context()                the forkserver context the launch starts workers from
    preload(*modules)        have it import these too (before it runs; later: nothing)
    start_early(cmd, argv)   the CLI, before it imports the command: start it now
    stop_early()             a world of one after all: stop what start_early started

Why early: a command that starts ranks imports torch itself (2.5 s here), then started
the forkserver, which imported torch and the command's modules (5 s: Dynamo is 2 of
them), then forked. Started at the command's start, the forkserver's imports run on
another core while this process imports its own. Torch-free: the CLI calls it before
anything imports torch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from multiprocessing import forkserver

PRELOAD = ["torch", "torch.distributed", "tpkit.launch", "tpkit.host.forkserver_exit"]
# The commands whose ranks it forks, started early, and what each of their ranks imports:
# train's module, and Dynamo (torch.optim's step imports it, 2 s of CPU here). A command
# launches once (`tpkit.launch.launch`; alone: `stop_early`). Not generate and serve:
# measured, their forkserver costs little (no Dynamo) and a killed one slowed tp=1 by
# 0.5 s; not verify, which launches one group per tp, tp=1 among them. They start theirs
# when they first start a worker.
COMMANDS = {"train": ("tpkit.commands.train", "torch._dynamo")}

_ctx = None  # the context, made once per process
_early: int | None = None  # the pid of a forkserver start_early started that has not forked


def context():
    """The forkserver context every tpkit worker process starts from (torch preloaded)."""
    global _ctx, _early
    _early = None  # someone starts workers from it: it is not ours to stop any more
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    _ensure_running()
    return _ctx


def _ensure_running() -> None:
    """Start the forkserver unless it runs, with SIGINT ignored, which it and every worker
    it forks inherit (an ignored signal stays ignored across exec): a Ctrl-C while it
    imports torch, or before a worker took SIGINT (`tpkit.host.stop.launcher_decides`),
    prints no KeyboardInterrupt traceback; the launcher stops them. (A Ctrl-C in the
    milliseconds of the start itself is lost here; the next one stops the command.)"""
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        forkserver.ensure_running()
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)


def preload(*modules: str) -> None:
    """Have the forkserver import `modules` too, once, before it forks the workers (which
    would each import them). Only before it runs; later, nothing changes."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # one context a process


def under_torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) that torchrun (or a tpkit worker) put in the environment."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def start_early(command: str, argv: list[str]) -> None:
    """Start the forkserver now if `command` is one whose ranks it forks (COMMANDS) and its
    command line names more than one (`--tp 2`, `--processes=4`...), unless it asks for
    help or torchrun started the ranks. A hint, not the rule that sizes the world (the
    command's configuration, a --config file included): a run of one it was wrong about
    stops it (`stop_early`), one of several it missed starts its forkserver when it forks."""
    global _early
    if command not in COMMANDS or "-h" in argv or "--help" in argv or \
            under_torchrun_env() or not _names_ranks(argv):
        return
    preload(*COMMANDS[command])
    before = forkserver._forkserver._forkserver_pid  # None: none runs in this process
    try:
        _ensure_running()
    except OSError:  # (no socket here, no process left): the first fork says it, as before
        return
    if before is None and _ctx is None:  # ours, and nothing forked from it yet
        _early = forkserver._forkserver._forkserver_pid


def _names_ranks(argv: list[str]) -> bool:
    """Whether the command line gives a parallel degree or a process count above 1
    (measured: a forkserver started for a run of one, then stopped, slowed it by 0.6 s)."""
    flags = ("--tp", "--pp", "--dp", "--cp", "--processes")
    for i, a in enumerate(argv):
        name, eq, value = a.partition("=")
        if name in flags:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "1")
            if value.strip() != "1":
                return True
    return False


def stop_early() -> None:
    """Stop the forkserver `start_early` started if nothing was forked from it (the
    command runs alone after all: its imports and memory go)."""
    global _early
    pid, _early = _early, None
    if pid is None or forkserver._forkserver._forkserver_pid != pid:
        return
    os.kill(pid, signal.SIGKILL)  # it may still be importing: do not wait for that
    forkserver._forkserver._stop()  # reaps it, closes our end, forgets its address
