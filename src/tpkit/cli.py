"""`tpkit <command>`: each command lives in its own module, imported only when used
(so `tpkit plan` and `tpkit quiz` start without importing torch).

A command module defines `add_arguments(parser)` and `run(args) -> int`.

One error path for every command: a user mistake (a bad flag, path, checkpoint,
preset, port; any `tpkit.spec.errors.UserError`) prints one line,

    tpkit <command>: error: <the cause, with its numbers>

and exits with status 2; a failed run (a rank died, a collective timed out) prints
one line and exits 1; anything else is a bug and keeps its traceback. `--debug` (or
TPKIT_DEBUG=1) shows the traceback of user mistakes too. tpkit's own warnings read
`tpkit <command>: warning: <text>`, one line (the library's keep Python's format).

A closed pipe (`tpkit presets | head -1`) ends a command quietly, as it ends Unix
tools: no traceback, exit status 128 + SIGPIPE = 141.

SIGTERM, SIGHUP and SIGINT stop a command cleanly: its worker processes are killed
and waited for, and it exits with 128 + the signal number, at once (the exit handlers
run; the interpreter's teardown, seconds with torch loaded, is skipped), with one line
and no traceback from any process. `tpkit train` honours a first SIGINT or SIGTERM at
its next step boundary (`tpkit.host.stop`: its ranks checkpoint, then stop); a second
one stops it at once.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from typing import NoReturn

from tpkit.commands.common import HelpFormatter, explain_parse_error
from tpkit.host import forkserver
from tpkit.host import stop as stop_point
from tpkit.host.exit import CLOSED_PIPE, Stopped, exit_now, quiet_stdout
from tpkit.host.forkserver import under_torchrun_env
from tpkit.spec.errors import RunFailed, UserError
from tpkit.spec.words import suggest

COMMANDS: dict[str, tuple[str, str]] = {
    "verify": ("tpkit.commands.verify", "check sharded layers/models against tp=1 (outputs, grads, ledger)"),
    "train": ("tpkit.commands.train", "train a model with tensor x pipeline x data parallelism"),
    "plan": ("tpkit.commands.plan", "plan tp/pp/dp for a model on a cluster (no torch needed)"),
    "calibrate": ("tpkit.commands.calibrate", "measure this machine into a hardware profile"),
    "convert": ("tpkit.commands.convert", "convert / reshard checkpoints, to and from safetensors"),
    "prepare-data": ("tpkit.commands.prepare_data", "tokenize text files into token shards "
                     "for training"),
    "generate": ("tpkit.commands.generate", "tensor-parallel text generation with a KV cache"),
    "serve": ("tpkit.commands.serve", "serve a model over an OpenAI-compatible HTTP API "
              "(continuous batching, tensor parallel)"),
    "cluster": ("tpkit.commands.cluster", "simulated hosts on this machine (network "
                "namespaces, root): up, run, status, down"),
    "quiz": ("tpkit.commands.quiz", "the tensor-parallelism quiz, as a live tutor (fr/en)"),
    "presets": ("tpkit.commands.presets", "list the model presets and the Hugging Face families"),
    "version": ("tpkit.commands.version", "versions of tpkit, torch, transformers and the "
                "transports available"),
}
USER_MISTAKE, RUN_FAILED = 2, 1  # exit statuses
_USER_OS_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                  FileExistsError)
_USER_OS_ERRORS = (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                   errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EEXIST, errno.ENOSPC)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _stop_on_signals() -> dict | None:
    """Turn SIGTERM, SIGHUP and SIGINT into `Stopped`, raised once in the main thread, so
    that every `with` and `finally` on the way out runs (the launcher kills its workers,
    a checkpoint being written stays a hidden temporary); later signals are ignored
    while it unwinds. Returns the previous handlers (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, _frame):
        if stop_point.pass_on(signum):  # `tpkit train`'s ranks save at their step boundary
            return
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum, stop_point.AGAIN if stop_point.asked() else "")

    return {s: signal.signal(s, stop) for s in _STOP_SIGNALS}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block, a close match suggested)
    and exit status 2; --help shows every default (`tpkit.commands.common`)."""

    def __init__(self, **kw) -> None:
        super().__init__(formatter_class=HelpFormatter, **kw)

    def error(self, message: str):  # noqa: D102 - argparse's hook
        message = explain_parse_error(self, message)
        self.exit(USER_MISTAKE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _usage() -> str:
    lines = ["usage: tpkit <command> [options]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {desc}" for name, (_, desc) in COMMANDS.items()]
    lines.append("\n`tpkit <command> --help` for the options of one command; "
                 "`tpkit --version` for the version.")
    return "\n".join(lines)


def explain(e: BaseException) -> tuple[str, int] | None:
    """(one line, exit status) for a user mistake or a failed run; None for a bug."""
    original = getattr(e, "original", None)  # SpawnError: what the failing rank raised
    if isinstance(original, BaseException):
        said, rank = explain(original), getattr(e, "rank", None)
        if said is None or rank is None or f"rank {rank}" in said[0]:
            return said
        return f"rank {rank}: {said[0]}", said[1]
    if isinstance(e, UserError):
        return _first_line(e), USER_MISTAKE
    if isinstance(e, RunFailed):  # a full disk, a diverged loss: said once, not a mistake
        return _first_line(e), RUN_FAILED
    if isinstance(e, _USER_OS_TYPES) or isinstance(e, OSError) and e.errno in _USER_OS_ERRORS:
        return _first_line(e), USER_MISTAKE
    if getattr(e, "run_failed", False):  # SpawnError: a rank died or a collective timed out
        return _first_line(e), RUN_FAILED
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tpkit` console script: the command's exit status. A closed
    pipe (`tpkit presets | head -1`) ends it quietly, as it ends Unix tools: no
    traceback, status 128 + SIGPIPE."""
    try:
        status = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a reader gone shows here, not in the interpreter's last flush
        return status
    except (Exception, SystemExit) as e:
        if not closed_pipe(e):
            raise
    quiet_stdout()
    return CLOSED_PIPE


def closed_pipe(e: BaseException) -> bool:
    """Whether `e` is (or, from a rank, carries) a write to a pipe whose reader is gone,
    or the exit a library chose on one (rich's console: SystemExit(1))."""
    if isinstance(e, SystemExit):
        return isinstance(e.__context__, BrokenPipeError)
    original = getattr(e, "original", None)  # SpawnError: what the failing rank raised
    return isinstance(e, BrokenPipeError) or isinstance(original, BrokenPipeError)


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name = argv[0]
    if name in ("-V", "--version"):
        # lazy: the CLI imports a command only when it runs
        from tpkit.commands.version import one_line

        print(one_line())
        return 0
    if name not in COMMANDS:
        print(f"tpkit: error: unknown command {name!r}{suggest(name, COMMANDS)} "
              f"(one of {', '.join(COMMANDS)})", file=sys.stderr)
        return USER_MISTAKE
    previous = warnings.formatwarning
    warnings.formatwarning = _warning_line(name, previous)
    try:
        return _command(name, argv[1:])
    finally:
        warnings.formatwarning = previous


def _warning_line(name: str, other: Callable) -> Callable:
    """A `warnings.formatwarning` that shows tpkit's own warnings (a category defined in
    tpkit: a damaged checkpoint skipped, a tp group across nodes) as one line, `tpkit
    <command>: warning: <text>`, not Python's `/path/x.py:12: CheckpointWarning: ...`
    and its source line; any other warning as `other` shows it."""

    def format_warning(message, category, filename, lineno, line=None) -> str:
        if category.__module__.partition(".")[0] == "tpkit":
            return f"tpkit {name}: warning: {message}\n"
        return other(message, category, filename, lineno, line)

    return format_warning


def _command(name: str, argv: list[str]) -> int:
    """Import, parse and run one command, its failures said in one line."""
    forkserver.start_early(name, argv)  # its imports run while this process makes its own
    try:
        return _parse_and_run(name, argv)
    finally:
        forkserver.stop_early()  # a mistake before any rank started: it goes at once


def command_parser(name: str, module=None) -> argparse.ArgumentParser:
    """The parser of `tpkit <name>`, as the command reads its line (and as the CLI
    reference of the documentation site shows it); `module`: the command's, imported."""
    module_name, desc = COMMANDS[name]
    parser = _Parser(prog=f"tpkit {name}", description=desc)
    (module or importlib.import_module(module_name)).add_arguments(parser)
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of user mistakes too (or TPKIT_DEBUG=1)")
    return parser


def _parse_and_run(name: str, argv: list[str]) -> int:
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"tpkit {name}: error: command {name!r} is not available in this build",
                  file=sys.stderr)
            return USER_MISTAKE
        raise
    args = command_parser(name, module).parse_args(argv)
    previous = _stop_on_signals()
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt as e:
        return _stopped(name, e, e)
    except Exception as e:
        if isinstance(getattr(e, "original", None), KeyboardInterrupt):  # the ranks stopped
            return _stopped(name, e.original, e)
        said = explain(e)
        if said is None or args.debug or os.environ.get("TPKIT_DEBUG") == "1":
            raise
        print(f"tpkit {name}: error: {said[0]}{getattr(e, 'then', '')}", file=sys.stderr)
        return said[1]
    finally:
        for s, handler in (previous or {}).items():
            signal.signal(s, handler)


def _stopped(name: str, e: KeyboardInterrupt, outer: BaseException) -> int:
    """The one stop line (rank 0's alone under torchrun), and 128 + the signal: what the
    stop saved (`Stopped.said`), then how to continue (`then`, from the command)."""
    signum = getattr(e, "signum", signal.SIGINT)
    if (under_torchrun_env() or (0, 1))[0] == 0:
        print(f"tpkit {name}: stopped by {signal.Signals(signum).name}"
              f"{getattr(e, 'said', '')}{getattr(outer, 'then', '')}", file=sys.stderr)
    return 128 + signum


def entry() -> NoReturn:
    """The `tpkit` console script and `python -m tpkit`: `main`, then the end of the
    process; stopped by a signal (everything already unwound and cleaned up), at once,
    without the interpreter's teardown (`exit_now`). `main` itself returns, so a caller
    in the same process keeps it (only `quiz --web`, a server, ends its process itself)."""
    status = main()
    if status - 128 in {int(s) for s in (*_STOP_SIGNALS, signal.SIGPIPE)}:
        exit_now(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
