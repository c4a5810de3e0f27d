"""Many tensors as one flat buffer: one collective instead of one per tensor.

    [g0 g1 g2]  --pack-->  flat [n0 + n1 + n2]  --all_reduce-->  --unpack_into--> [g0 g1 g2]

Used by data parallelism (gradient buckets), ZeRO-1 (the flattened parameters) and
the tensor-parallel gradient sums of sequence-parallel parameters.
"""

from __future__ import annotations

import torch

from tpkit.comm.collectives import all_reduce
from tpkit.comm.group import CommGroup


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor holding every tensor's elements, in order."""
    return torch.cat([t.reshape(-1) for t in tensors])  # [sum numel]


def unpack(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive pieces of `flat`, shaped like each tensor of `like`."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def unpack_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of `flat` back into `tensors` (the inverse of `pack`)."""
    for t, piece in zip(tensors, unpack(flat, tensors)):
        t.copy_(piece)


def all_reduce_flat(tensors: list[torch.Tensor], group: CommGroup, *, average: bool = False,
                    phase: str, scope: str) -> None:
    """Sum (or average) `tensors` in place over `group` with a single all-reduce."""
    flat = pack(tensors)  # [sum numel]
    all_reduce(flat, group, phase=phase, scope=scope)
    if average:
        flat /= group.size
    unpack_into(flat, tensors)
