"""No NaN or infinity in weights goes unsaid: refused when a checkpoint is written or
resumed, warned of when a model is loaded.

A run whose loss diverged has weights (and AdamW moments) full of NaN; a checkpoint of
them would become the run's "latest" and every resume, export or `generate` would go
on from garbage. `first_nonfinite` finds the first such tensor (one pass, in memory
already); the checkpoint writer refuses to write it (`NonFiniteCheckpoint`, exit 1,
the previous checkpoint stays the newest), a resume refuses a file written before this
check. Loading a model for use (`tpkit generate`, `serve`, `convert`, `tpkit.load`: any
file, a Hugging Face one too) warns in one line naming every such tensor
(`warn_nonfinite`): its outputs would be NaN or garbage, without a word.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from tpkit.spec.errors import RunFailed


class NonFiniteCheckpoint(RunFailed):
    """A tensor to be saved holds NaN or inf: the checkpoint is not written."""


class NonFiniteWeights(UserWarning):
    """Weights just loaded hold NaN or inf."""


def finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN or inf. Screened by its sum (NaN and inf carry through a
    sum; a finite sum means a finite tensor), the element-wise test only when the sum is
    not finite (an overflow, or a NaN): about a sixth of its time on CPU."""
    return (not t.is_floating_point() or bool(torch.isfinite(t.sum()))
            or bool(torch.isfinite(t).all()))


def nonfinite(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    """(name, non-finite count, size) of every tensor holding NaN or inf."""
    return [(name, int((~torch.isfinite(t)).sum()), t.numel()) for name, t in tensors.items()
            if not finite(t)]


def first_nonfinite(tensors: Mapping[str, torch.Tensor]) -> tuple[str, int, int] | None:
    """(name, non-finite count, size) of the first tensor holding NaN or inf, or None."""
    return next(((name, int((~torch.isfinite(t)).sum()), t.numel())
                 for name, t in tensors.items() if not finite(t)), None)


def describe(found: tuple[str, int, int]) -> str:
    """'layers.0.mlp.fc1.weight holds 2,048 non-finite values (nan/inf) of 8,192'."""
    name, bad, size = found
    return f"{name} holds {bad:,} non-finite values (nan/inf) of {size:,}"


def warn_nonfinite(names: list[str], where: str, here: bool = True) -> None:
    """One warning line naming the tensors just loaded from `where` that hold NaN or inf
    (`here`: on this rank; the others know it and stay silent); none when none does."""
    if names and here:
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        warnings.warn(f"{where}: {len(names)} weight tensor(s) hold NaN or inf: "
                      f"{', '.join(names[:8])}{more}; the model's outputs will be NaN or "
                      f"garbage", NonFiniteWeights, stacklevel=3)
