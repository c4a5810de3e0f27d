"""`ParallelMesh`: the process groups over the (dp, pp, cp, tp) rank grid of `tpkit.spec.grid`.

    rank = ((dp_index * pp + pp_index) * cp + cp_index) * tp + tp_index

    world=8, tp=2, pp=2, dp=2          node 0 (4 GPUs)     node 1 (4 GPUs)
      dp0: pp0 [0 1]  pp1 [2 3]        [0 1 | 2 3]         [4 5 | 6 7]
      dp1: pp0 [4 5]  pp1 [6 7]         tp    tp            tp    tp

Each tensor-parallel group is a run of consecutive ranks, so with torchrun's
numbering (LOCAL_WORLD_SIZE ranks per node) it stays inside one node, on NVLink:
tensor parallelism sends an all-reduce of the activations 4 times per layer and
micro-batch, which only the fast intra-node link can carry (quiz answers 3 and 8).
A tp group that would span nodes is warned about loudly, or refused with
`strict_locality=True`; `tpkit train` adds the planner's price of it (in ms per layer)
to the warning, and `tpkit plan` prices any layout.

Every group whose ranks share a host (and a node of the grid) also gets a shared-memory
channel (`comm/shm.py`) unless `comm="gloo"` (`comm/transport.py`): its collectives
then cost microseconds instead of gloo's loopback TCP.

Context parallelism (cp > 1) is a dimension of its own, right outside tp: `cp_group`
is the ring of ranks that split each sequence (`tpkit.parallel.context`). The cp ranks
of a replica hold the same weights as the other replicas, so the gradients are averaged
over `dp_cp_group` (dp x cp ranks: the same pp and tp coordinate); with cp=1 it is the
dp group itself.
"""

from __future__ import annotations

import os
import socket
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from tpkit.comm.failure import DEFAULT_COLLECTIVE_TIMEOUT_S
from tpkit.comm.group import CommGroup
from tpkit.comm.incarnation import agree_prefix, env_store
from tpkit.comm.ledger import Ledger
from tpkit.comm.shm import ShmChannel
from tpkit.comm.transport import on_one_host, shm_ready, shm_wanted
from tpkit.host.addresses import interface_reaching
from tpkit.host.device import default_backend, device_for
from tpkit.spec.errors import UserError
from tpkit.spec.grid import (
    check_sizes,
    coord_of,
    group_ranks,
    locality_problem,
    rank_grid,
    world_of,
)
from tpkit.spec.transport import comm_choice


class TopologyWarning(UserWarning):
    """A tensor-parallel group spans more than one node."""


class ParallelMesh:
    """The process groups of 3D parallelism, passed explicitly to every layer.

    `mesh.tp_group` (a `CommGroup`), `mesh.tp_rank`, `mesh.tp_size`, and the same for
    pp, cp and dp; `mesh.dp_cp_group` (and `_rank`, `_size`) holds every rank with the
    same weights, the group gradients are averaged over (dp x cp); `mesh.mp_group`
    spans one model replica's stages (tp x pp at one cp index); `mesh.ledger`
    records every collective of this rank. A collective on any of its groups that
    waits longer than `timeout_s` (a dead or stuck peer) raises `CollectiveFailed`.
    `comm` (auto, shm, gloo; default TPKIT_COMM, else auto) picks the transport of the
    groups inside one host (`tpkit.comm.transport`).
    Construct it on every rank with the same arguments after the default process group
    exists, or use `from_env` / `single`.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, *,
                 rank: int | None = None,
                 world_size: int | None = None, ranks_per_node: int | None = None,
                 strict_locality: bool = False, ledger: Ledger | None = None,
                 device: torch.device | None = None, timeout_s: float | None = None,
                 comm: str | None = None, _virtual: bool = False) -> None:
        initialized = not _virtual and dist.is_available() and dist.is_initialized()
        self.world_size = world_size if world_size is not None else (
            dist.get_world_size() if initialized else 1)
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        check_sizes(self.world_size, tp, pp, dp, cp)
        self.tp_size, self.pp_size, self.dp_size, self.cp_size = tp, pp, dp, cp
        self.ranks_per_node = ranks_per_node or (
            None if _virtual else _env_int("LOCAL_WORLD_SIZE")) or self.world_size
        if not _virtual:
            self._check_locality(strict_locality)
        self.ledger = ledger or Ledger()
        self.backend = "none" if _virtual else dist.get_backend() if initialized else "gloo"
        self.device = torch.device("meta") if _virtual else device or device_for(
            self.backend, _env_int("LOCAL_RANK") or 0)
        self.coord = coord_of(self.rank, tp, pp, cp)
        self.timeout = timedelta(seconds=timeout_s or DEFAULT_COLLECTIVE_TIMEOUT_S)
        if self.world_size > 1 and not initialized and not _virtual:
            raise RuntimeError("ParallelMesh with world_size > 1 needs torch.distributed to be "
                               "initialized first (use ParallelMesh.from_env or tpkit.launch)")
        self.comm = "gloo" if _virtual else comm_choice(comm)
        self._hosts = None if _virtual else self._shm_hosts()
        make = self._no_process_group if _virtual else self._make_group
        self.groups = {k: make(k) for k in ("tp", "pp", "dp", "mp")}
        if cp > 1:  # with cp=1 the ranks that share the weights are the dp group
            self.groups.update({k: make(k) for k in ("cp", "dp_cp")})
        else:
            self.groups.update(cp=make("cp"), dp_cp=self.groups["dp"])
        self._extra: dict[str, CommGroup | None] = {}

    # -- construction ------------------------------------------------------------------
    @classmethod
    def single(cls, ledger: Ledger | None = None, device: torch.device | str | None = None
               ) -> ParallelMesh:
        """A one-process mesh (tp = pp = dp = 1): the single-device reference, on the CPU
        unless `device` says otherwise (e.g. `tpkit.host.device.best_device()`)."""
        return cls(1, 1, 1, rank=0, world_size=1, ledger=ledger,
                   device=torch.device(device) if device is not None else None)

    @classmethod
    def virtual(cls, tp: int = 1, pp: int = 1, dp: int = 1, rank: int = 0,
                ranks_per_node: int | None = None, cp: int = 1) -> ParallelMesh:
        """A mesh with no processes behind it: sizes and coordinates only, for building
        models on the meta device (parameter counts, memory) at any layout. Any
        collective on it raises."""
        return cls(tp, pp, dp, cp, rank=rank, world_size=world_of(tp, pp, dp, cp),
                   ranks_per_node=ranks_per_node, _virtual=True)

    @classmethod
    def from_env(cls, tp: int | None = None, pp: int = 1, dp: int | None = None,
                 timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, cp: int = 1,
                 **kw) -> ParallelMesh:
        """Build from torchrun's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_*).

        Initializes the default process group if needed (nccl with CUDA, else gloo).
        Leave tp or dp as None to take whatever the world leaves over.
        """
        world = _env_int("WORLD_SIZE") or (dist.get_world_size() if dist.is_initialized() else 1)
        tp, dp = _fill_sizes(world, tp, pp * cp, dp)
        check_sizes(world, tp, pp, dp, cp)  # before any collective, on every rank
        if world > 1 and not dist.is_initialized():
            _init_default_group(timedelta(seconds=timeout_s))
        return cls(tp, pp, dp, cp, timeout_s=timeout_s, **kw)

    def _check_locality(self, strict: bool) -> None:
        problem = locality_problem(self.tp_size, self.pp_size, self.dp_size, self.ranks_per_node,
                                   self.cp_size)
        if problem is None:
            return
        if strict:
            raise UserError(problem)
        warnings.warn(problem, TopologyWarning, stacklevel=3)

    def extra_group(self, key: str, name: str, all_ranks: list[tuple[int, ...]]
                    ) -> CommGroup | None:
        """This rank's group among `all_ranks` (every group of one kind, the same list on
        every rank), created once per mesh and cached under `key`; None if this rank is in
        none. Collective the first time: every rank must call it, in the same order."""
        if key not in self._extra:
            self._extra[key] = self._group_among(name, all_ranks)
        return self._extra[key]

    def _group_among(self, name: str, all_ranks: list[tuple[int, ...]],
                     reuse_world: bool = False) -> CommGroup | None:
        mine = None
        for ranks in all_ranks:
            pg = None
            if len(ranks) > 1:  # every rank must create every group, in the same order
                pg = dist.GroupMember.WORLD if reuse_world and len(ranks) == self.world_size \
                    else dist.new_group(list(ranks), timeout=self.timeout)
            if self.rank in ranks:
                mine = CommGroup(name, ranks, ranks.index(self.rank), pg, self.ledger)
        if mine is not None and self._hosts and on_one_host(mine.ranks, self._hosts,
                                                           self.ranks_per_node):
            mine.shm = ShmChannel.open(name, mine.ranks, mine.rank, mine.pg,
                                       self.timeout.total_seconds(),
                                       os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return mine

    def _shm_hosts(self) -> list[str] | None:
        """Every rank's hostname when groups may use shared memory, else None (collective)."""
        if self.world_size == 1 or not shm_wanted(self.comm, self.backend) or \
                not shm_ready(self.comm, self.rank):
            return None
        hosts: list = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        return hosts

    def _no_process_group(self, kind: str) -> CommGroup:
        """This rank's group of `kind` with no process group behind it (a virtual mesh)."""
        ranks = next(g for g in self.all_groups(kind) if self.rank in g)
        return CommGroup(kind, ranks, ranks.index(self.rank), None, self.ledger)

    def _make_group(self, kind: str) -> CommGroup:
        mine = self._group_among(kind, self.all_groups(kind), reuse_world=True)
        assert mine is not None
        return mine

    def all_groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of `kind` in this mesh's grid (`tpkit.spec.grid.group_ranks`)."""
        return group_ranks(kind, self.tp_size, self.pp_size, self.dp_size, self.cp_size)

    # -- accessors ---------------------------------------------------------------------
    @property
    def tp_group(self) -> CommGroup:
        """This rank's tensor-parallel group."""
        return self.groups["tp"]

    @property
    def pp_group(self) -> CommGroup:
        """This rank's pipeline group (one rank per stage)."""
        return self.groups["pp"]

    @property
    def dp_group(self) -> CommGroup:
        """This rank's data-parallel group (one rank per replica)."""
        return self.groups["dp"]

    @property
    def cp_group(self) -> CommGroup:
        """This rank's context-parallel ring (the ranks splitting each sequence)."""
        return self.groups["cp"]

    @property
    def dp_cp_group(self) -> CommGroup:
        """Every rank holding the same weights (dp x cp): the gradients' average, ZeRO's
        and FSDP's shards. With cp=1 it is `dp_group`."""
        return self.groups["dp_cp"]

    @property
    def mp_group(self) -> CommGroup:
        """All ranks holding one model replica (tp x pp)."""
        return self.groups["mp"]

    @property
    def tp_rank(self) -> int:
        """Index inside the tp group."""
        return self.coord.tp

    @property
    def pp_rank(self) -> int:
        """Pipeline stage index."""
        return self.coord.pp

    @property
    def dp_rank(self) -> int:
        """Data-parallel replica index."""
        return self.coord.dp

    @property
    def cp_rank(self) -> int:
        """Index inside the cp ring."""
        return self.coord.cp

    @property
    def dp_cp_rank(self) -> int:
        """Index inside the dp x cp group (replica * cp + cp index)."""
        return self.dp_cp_group.rank

    @property
    def dp_cp_size(self) -> int:
        """Ranks holding the same weights: dp x cp."""
        return self.dp_cp_group.size

    @property
    def layout(self) -> dict[str, int]:
        """{"tp", "pp", "dp"} sizes (and "cp" when > 1): a checkpoint's layout as its
        manifest records it."""
        cp = dict(cp=self.cp_size) if self.cp_size > 1 else {}
        return dict(tp=self.tp_size, pp=self.pp_size, dp=self.dp_size, **cp)

    @property
    def hosts(self) -> list[str] | None:
        """Every rank's hostname, in rank order (None: not gathered, e.g. --comm gloo)."""
        return self._hosts

    def transports(self) -> str:
        """This rank's groups of more than one rank and what each travels over, e.g.
        "tp shm, pp gloo over eth0" (`CommGroup.transport`); "none" on one rank."""
        kinds = ("tp", "cp", "pp", "dp")
        return ", ".join(f"{k} {self.groups[k].transport}" for k in kinds
                         if self.groups[k].size > 1) or "none"

    def describe(self) -> str:
        """The rank grid as text (quiz answer 6)."""
        cp = f" x cp={self.cp_size}" if self.cp_size > 1 else ""
        lines = [f"world={self.world_size}: tp={self.tp_size} x pp={self.pp_size}{cp} x "
                 f"dp={self.dp_size}, {self.ranks_per_node} ranks per node"]
        grid = rank_grid(self.tp_size, self.pp_size, self.dp_size, self.cp_size)
        for d, stages in enumerate(grid):
            row = "  ".join(f"pp{p}:{ranks}" for p, ranks in enumerate(stages))
            lines.append(f"  dp{d}: {row}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        cp = f", cp={self.cp_size}" if self.cp_size > 1 else ""
        return (f"ParallelMesh(rank={self.rank}, tp={self.tp_size}, pp={self.pp_size}{cp}, "
                f"dp={self.dp_size}, coord={self.coord})")


def _init_default_group(timeout: timedelta) -> None:
    """The default process group from torchrun's environment, its keys in the store under
    a prefix of this incarnation (`tpkit.comm.incarnation`): after a restart
    (`--max-restarts`) the store still holds the dead incarnation's addresses under the
    same group names, and a new rank that read them would connect to a dead peer (or hang)."""
    _gloo_interface()
    store, rank, world = env_store(timeout)
    store.set_timeout(timeout)
    prefix = agree_prefix(store, rank, world, timeout)
    dist.init_process_group(default_backend(), store=dist.PrefixStore(prefix, store),
                            rank=rank, world_size=world, timeout=timeout)


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v else None


def _fill_sizes(world: int, tp: int | None, rest: int, dp: int | None) -> tuple[int, int]:
    """(tp, dp), either left None taking what the world leaves over (`rest`: pp x cp)."""
    if tp is None and dp is None:
        return 1, max(world // rest, 1)
    if tp is None:
        return max(world // (rest * dp), 1), dp
    if dp is None:
        return tp, max(world // (tp * rest), 1)
    return tp, dp


def _gloo_interface() -> None:
    """Tell gloo which interface reaches the other hosts (GLOO_SOCKET_IFNAME, unless the
    user set it): the one this host reaches MASTER_ADDR through. Left to gloo (this
    host's name resolved) when that is loopback: one host, or a master address that
    resolves to loopback here."""
    master = os.environ.get("MASTER_ADDR")
    if master and "GLOO_SOCKET_IFNAME" not in os.environ:
        name = interface_reaching(master)
        if name and name != "lo":
            os.environ["GLOO_SOCKET_IFNAME"] = name
