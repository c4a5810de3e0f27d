"""`CommGroup`: a process group together with what a collective needs without asking.

A group of one rank has no process group at all: every collective on it is a no-op,
which is how the tp=1 model is the very same code as the sharded one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from tpkit.comm.ledger import Ledger


@dataclass(eq=False)
class CommGroup:
    """Ranks that talk to each other for one kind of parallelism (tp, pp or dp)."""

    name: str  # "tp", "pp", "dp" or a custom label
    ranks: tuple[int, ...]  # global ranks, in group order
    rank: int  # this process's index inside `ranks`
    pg: dist.ProcessGroup | None = None  # None when size == 1
    ledger: Ledger = field(default_factory=Ledger)

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @classmethod
    def single(cls, name: str = "tp", ledger: Ledger | None = None) -> CommGroup:
        """A group of one: nothing is ever sent (the single-device reference)."""
        return cls(name=name, ranks=(0,), rank=0, pg=None, ledger=ledger or Ledger())

    def __repr__(self) -> str:
        return f"CommGroup({self.name}, ranks={list(self.ranks)}, rank={self.rank})"
