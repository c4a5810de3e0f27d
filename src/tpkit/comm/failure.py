"""`CollectiveFailed`: a collective that did not complete, said in one line.

A peer that died closes its sockets (gloo: "Connection reset by peer", at once); a
peer that stopped (SIGSTOP, a deadlock, an endless loop) makes the others wait until
the group's timeout (`--collective-timeout`). Either way the rank that was waiting
raises this, naming the collective, its group and ranks, the ledger scope it ran in,
how long it waited and, once the training loop adds it, the last step completed:

    rank 0: all_reduce over tp [0, 1] (scope layers.2.mlp, forward) timed out after
    5.0 s (a peer is stuck or cut off; suspects: rank 1); last step completed: 12
"""

from __future__ import annotations

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0  # a collective waiting longer than this fails
# what gloo / NCCL say when a peer died, stopped or timed out (not a bug of the caller)
_LINK_FAILURES = ("timed out", "timeout", "connection reset", "connection closed",
                  "connection refused", "broken pipe", "socket", "nccl", "watchdog")


def says_link_failed(message: str) -> bool:
    """True when an error message is gloo's or NCCL's for a peer that died, stopped or
    timed out (a closed socket reads "Connection reset", "closed" or "Broken pipe",
    depending on where the peer's death met the transfer)."""
    return any(k in message.lower() for k in _LINK_FAILURES)


class CollectiveFailed(RuntimeError):
    """A collective failed on this rank because a peer died, stopped or timed out."""

    run_failed = True  # not a bug, not a user mistake: the run could not go on

    def __init__(self, op: str, group: str, ranks: tuple[int, ...], me: int, scope: str,
                 phase: str, seconds: float, cause: str, peer: int | None = None,
                 step: int | None = None, hosts: list[str] | None = None) -> None:
        self.op, self.group, self.ranks, self.me = op, group, tuple(ranks), me
        self.scope, self.phase, self.seconds, self.cause = scope, phase, seconds, cause
        self.peer, self.step, self.hosts = peer, step, hosts
        super().__init__(self.describe())

    @property
    def timed_out(self) -> bool:
        """True when the peer is silent (stuck), False when it closed the link (dead)."""
        return "timed out" in self.cause.lower() or "timeout" in self.cause.lower()

    @property
    def suspects(self) -> list[int]:
        """Ranks that may have caused it: the p2p peer, else every other group member."""
        return [self.peer] if self.peer is not None else [r for r in self.ranks if r != self.me]

    def describe(self) -> str:
        """The one-line message."""
        what = (f"timed out after {self.seconds:.1f} s (a peer is stuck or cut off"
                if self.timed_out else
                f"failed after {self.seconds:.1f} s (a peer closed the connection: it died")
        who = ", ".join(f"rank {r}{self._on_host(r)}" for r in self.suspects)
        step = "none" if self.step is None else self.step
        return (f"rank {self.me}: {self.op} over {self.group} {list(self.ranks)} (scope "
                f"{self.scope or 'top level'}, {self.phase}) {what}; suspects: {who}); "
                f"last step completed: {step}")

    def _on_host(self, rank: int) -> str:
        """' on host NAME' when the ranks span hosts (a lost host is named), else ''."""
        if not self.hosts or len(set(self.hosts)) < 2 or rank >= len(self.hosts):
            return ""
        return f" on host {self.hosts[rank]}"

    def after_step(self, step: int, hosts: list[str] | None = None) -> CollectiveFailed:
        """This error, knowing the last step completed (set by the training loop) and
        every rank's host (`ParallelMesh.hosts`), to name the host of a suspect."""
        self.step, self.hosts = step, hosts or self.hosts
        self.args = (self.describe(),)
        return self

    def __reduce__(self):
        return (CollectiveFailed, (self.op, self.group, self.ranks, self.me, self.scope,
                                   self.phase, self.seconds, self.cause, self.peer, self.step,
                                   self.hosts))
