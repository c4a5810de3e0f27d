"""Which transport a group uses: shared memory inside one host, the process group across.

The run's choice (`--comm auto|shm|gloo`, TPKIT_COMM) is read by `spec.transport`;
here it meets the machine: the backend, the kernels, the hosts of the ranks. If the
kernels cannot be built or loaded, `auto` runs on gloo with one warning line (rank 0).
"""

from __future__ import annotations

import functools
import sys

from tpkit.comm.shm_build import load, unavailable_reason
from tpkit.spec.errors import UserError
from tpkit.spec.grid import nodes_spanned


def shm_wanted(comm: str, backend: str) -> bool:
    """Would this run put same-host groups on shared memory? (never on NCCL)"""
    if comm == "gloo":
        return False
    if backend != "gloo":
        if comm == "shm":
            raise UserError(f"--comm shm needs CPU ranks (gloo); this run uses {backend}")
        return False
    return True


def shm_ready(comm: str, rank: int) -> bool:
    """True if the kernels load; else an error (comm="shm") or one warning on rank 0."""
    if load() is not None:
        return True
    reason = unavailable_reason()
    if comm == "shm":
        raise UserError(f"--comm shm: the shared-memory kernels are not available ({reason}); "
                        f"build them with `python -m tpkit.comm.shm_build` or use --comm gloo")
    if rank == 0:
        _warn_once(f"tpkit: warning: shared-memory transport unavailable ({reason}); all "
                   f"groups use gloo")
    return False


@functools.cache  # once per process and reason, however many meshes
def _warn_once(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def on_one_host(ranks: tuple[int, ...], hosts: list[str], ranks_per_node: int) -> bool:
    """Are all of the group's ranks on one host (hostnames) and one node of the grid?"""
    return len(ranks) > 1 and len({hosts[r] for r in ranks}) == 1 and \
        nodes_spanned(ranks, ranks_per_node) == 1

