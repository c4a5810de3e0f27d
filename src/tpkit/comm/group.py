"""`CommGroup`: a process group together with what a collective needs without asking.

A group of one rank has no process group at all: every collective on it is a no-op,
which is how the tp=1 model is the very same code as the sharded one. A group whose
ranks share a host also carries a shared-memory channel (`shm`), which the collectives
use instead of the process group for the tensors it takes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.distributed as dist

from tpkit.comm.ledger import Ledger
from tpkit.comm.shm import ShmChannel


@dataclass(eq=False)
class CommGroup:
    """Ranks that talk to each other for one kind of parallelism (tp, pp or dp)."""

    name: str  # "tp", "pp", "dp" or a custom label
    ranks: tuple[int, ...]  # global ranks, in group order
    rank: int  # this process's index inside `ranks`
    pg: dist.ProcessGroup | None = None  # None when size == 1
    ledger: Ledger = field(default_factory=Ledger)
    shm: ShmChannel | None = None  # the shared-memory transport, for ranks of one host
    sp_seq: int | None = None  # the whole sequence that SP splits over the group, while
    #                            `ops.sequence` says (None: every rank holds an equal part)

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @classmethod
    def single(cls, name: str = "tp", ledger: Ledger | None = None) -> CommGroup:
        """A group of one: nothing is ever sent (the single-device reference)."""
        return cls(name=name, ranks=(0,), rank=0, pg=None, ledger=ledger or Ledger())

    @property
    def transport(self) -> str:
        """What the collectives travel over: "shm", the process group's backend ("gloo
        over eth0" when GLOO_SOCKET_IFNAME names its interface), or "none" (one rank)."""
        if self.shm is not None:
            return "shm"
        if self.pg is None:
            return "none"
        backend = str(dist.get_backend(self.pg))
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        return f"{backend} over {ifname}" if backend == "gloo" and ifname else backend

    def __repr__(self) -> str:
        via = ", shm" if self.shm is not None else ""
        return f"CommGroup({self.name}, ranks={list(self.ranks)}, rank={self.rank}{via})"
