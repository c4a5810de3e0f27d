"""No checkpoint holds a NaN or an infinity: checked when written and when read.

A run whose loss diverged has weights (and AdamW moments) full of NaN; a checkpoint of
them would become the run's "latest" and every resume, export or `generate` would go
on from garbage. `first_nonfinite` finds the first such tensor (one pass, in memory
already); the writer refuses to write it (`NonFiniteCheckpoint`, exit 1, the previous
checkpoint stays the newest), the reader refuses a file written before this check.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tpkit.spec.errors import RunFailed


class NonFiniteCheckpoint(RunFailed):
    """A tensor to be saved holds NaN or inf: the checkpoint is not written."""


def first_nonfinite(tensors: Mapping[str, torch.Tensor]) -> tuple[str, int, int] | None:
    """(name, non-finite count, size) of the first tensor holding NaN or inf, or None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name, int((~torch.isfinite(t)).sum()), t.numel()
    return None


def describe(found: tuple[str, int, int]) -> str:
    """'layers.0.mlp.fc1.weight holds 2,048 non-finite values (nan/inf) of 8,192'."""
    name, bad, size = found
    return f"{name} holds {bad:,} non-finite values (nan/inf) of {size:,}"
