"""Silent-divergence guard: what must be identical on every tp rank, checked cheaply.

A parameter replicated over tp (no split tag: norm weights, row-parallel biases,
router weights, ...) is updated independently on each tp rank from gradients that
the tp all-reduces made equal; a bug, a non-deterministic kernel or a bad device
can make one copy drift, and nothing else would ever notice. Every N steps
(`tpkit train --check-replicas N`) each rank reduces every replicated parameter to
two exact integer checksums of its bytes (their sum, and a position-weighted sum
that also catches moved elements), and two all-reduces over tp (max, min) compare
them: 2 integers per parameter, no matter its size. Any difference stops the run
with one line naming the parameter, the ranks that disagree and the step.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm import all_gather, all_reduce
from tpkit.comm.group import CommGroup
from tpkit.layers.sharding import split_of


class ReplicaMismatch(RuntimeError):
    """A parameter that must be identical on every tp rank is not."""

    run_failed = True  # not a user mistake: the run cannot go on (one line, exit 1)


def _checksums(p: torch.Tensor) -> torch.Tensor:
    """[2] int64: the sum of the bytes and their position-weighted sum (exact)."""
    b = p.detach().reshape(-1).contiguous().view(torch.uint8).long()  # [bytes]
    w = torch.arange(b.numel(), device=b.device) % 8191 + 1  # [bytes]
    return torch.stack([b.sum(), (b * w).sum()])


def check_replicas(model: nn.Module, group: CommGroup, step: int) -> None:
    """Raise ReplicaMismatch unless every replicated parameter has the same bytes on
    every rank of `group`; call on every rank of it."""
    names = [n for n, p in model.named_parameters() if split_of(p) is None]
    if group.size == 1 or not names:
        return
    params = dict(model.named_parameters())
    mine = torch.cat([_checksums(params[n]) for n in names])  # [2 * params]
    hi, lo = mine.clone(), mine.clone()
    all_reduce(hi, group, op="max", phase="check", scope="replicas")
    all_reduce(lo, group, op="min", phase="check", scope="replicas")
    bad = (hi != lo).nonzero()
    if len(bad) == 0:
        return
    i = int(bad[0]) // 2
    every = all_gather(mine[2 * i:2 * i + 2].unsqueeze(0), group, dim=0)  # [tp, 2]
    odd = [group.ranks[r] for r in range(group.size) if not torch.equal(every[r], every[0])]
    raise ReplicaMismatch(f"step {step}: replicated parameter {names[i]!r} differs across "
                          f"the tp ranks {list(group.ranks)}: ranks {odd} disagree with rank "
                          f"{group.ranks[0]} ({len(bad) // 2 or 1} parameter(s) differ)")
