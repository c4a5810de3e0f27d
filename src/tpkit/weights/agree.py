"""Every rank agrees before anything changes: a failed read or write on one rank is
an error on every rank (its own message where it failed, `peer_failed` elsewhere),
never a half-loaded model or a hang.

    err = attempt(stage, ...)                     # this rank's exception, or None
    raise_unless_all(mesh, err, "another rank failed ...")   # a barrier over the world
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tpkit.comm import all_reduce
from tpkit.mesh import ParallelMesh
from tpkit.spec.errors import CheckpointError


def attempt(fn: Callable, *args: Any) -> BaseException | None:
    """Run `fn(*args)`; its exception (reported once every rank agreed), or None."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - reported after every rank agreed
        return e
    return None


def agree(mesh: ParallelMesh, ok: bool) -> bool:
    """True when every rank says ok (a barrier over the whole world: mp, then dp x cp)."""
    flag = torch.tensor([1.0 if ok else 0.0], device=mesh.device)
    all_reduce(flag, mesh.mp_group, op="min", phase="checkpoint")
    all_reduce(flag, mesh.dp_cp_group, op="min", phase="checkpoint")
    return bool(flag.item() == 1.0)


def raise_unless_all(mesh: ParallelMesh, err: BaseException | None, other: str) -> None:
    """Raise `err` on the rank that failed and CheckpointError(`other`, peer_failed) on
    the others, unless no rank failed."""
    if not agree(mesh, err is None):
        raise err if err is not None else CheckpointError(other, peer_failed=True)
