"""`UserError`: a mistake of the user (a flag, a path, a file, a port), not a bug.

Every command reports one as a single line, `tpkit <command>: error: <cause>`, and
exits with status 2; anything else is a bug and keeps its traceback. Raise it (or a
subclass) wherever the cause is known and can be named with its numbers. It is a
`ValueError`, so code that already catches configuration errors keeps doing so.
`CheckpointError` (a damaged or unfitting checkpoint) is one; `CheckpointWarning` says a
damaged checkpoint was skipped. Pure Python: every layer of tpkit may import them.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake the user can fix: reported in one line naming the cause, exit status 2."""


class RunFailed(RuntimeError):
    """The run failed, not the user (a full disk, a diverged loss): one line naming the
    cause, exit status 1. Never a side effect of another rank's failure (the launcher
    shows this rank's error first)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, damaged, or does not fit the model; names the file.

    `peer_failed=True`: this rank is fine, another rank failed (its error is the one
    to show)."""

    def __init__(self, message: str, *, peer_failed: bool = False) -> None:
        super().__init__(message)
        self.peer_failed = peer_failed

    def __reduce__(self):
        return (_checkpoint_error, (str(self), self.peer_failed))


def _checkpoint_error(message: str, peer_failed: bool) -> CheckpointError:
    return CheckpointError(message, peer_failed=peer_failed)


class CheckpointWarning(UserWarning):
    """A newer checkpoint in a run folder was skipped because it is damaged."""
