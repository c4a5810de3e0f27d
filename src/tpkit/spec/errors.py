"""`UserError`: a mistake of the user (a flag, a path, a file, a port), not a bug.

Every command reports one as a single line, `tpkit <command>: error: <cause>`, and
exits with status 2; anything else is a bug and keeps its traceback. Raise it (or a
subclass) wherever the cause is known and can be named with its numbers. It is a
`ValueError`, so code that already catches configuration errors keeps doing so.
Pure Python: every layer of tpkit may import it.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake the user can fix: reported in one line naming the cause, exit status 2."""


class RunFailed(RuntimeError):
    """The run failed, not the user (a full disk, a diverged loss): one line naming the
    cause, exit status 1. Never a side effect of another rank's failure (the launcher
    shows this rank's error first)."""
