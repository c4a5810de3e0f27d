"""A NaN or an infinity stops the run before it spreads (or, on request, skips the step).

    guard = NonFiniteGuard(cfg.on_nonfinite, cfg.nonfinite_skips)
    ...
    if guard.skip(step, loss, norm, model, rank):   # after the grad norm, before the update
        (no clip, no optimizer step: the weights stay those of the last good step)

The loss (averaged over replicas) and the global gradient norm are both all-reduced
before this check, so every rank holds the same two numbers and reaches the same
verdict: no rank steps while another stops, and no extra collective is needed.

`stop` (the default): the first non-finite step ends the run with one line naming
the step and the first non-finite quantity (the loss, else the gradient norm and the
first parameter whose gradient is non-finite on this rank), exit 1. `skip`: the
update is skipped and counted (Megatron's behaviour with a loss scaler); `limit` skips
in a row stop the run all the same.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tpkit.spec.errors import RunFailed


class NonFiniteLoss(RunFailed):
    """The loss or the gradient norm of a step is NaN or infinite: the run stops."""


class NonFiniteGuard:
    """Per-run state of the check: the policy and how many steps in a row were skipped."""

    def __init__(self, policy: str = "stop", limit: int = 3) -> None:
        self.policy, self.limit = policy, limit
        self.in_row = self.skipped = 0

    def skip(self, step: int, loss: float, norm: float, model: nn.Module, rank: int) -> bool:
        """True: skip this step's update; raises NonFiniteLoss to stop the run."""
        what = first_nonfinite(loss, norm, model, rank)
        if what is None:
            self.in_row = 0
            return False
        self.in_row, self.skipped = self.in_row + 1, self.skipped + 1
        if self.policy == "skip" and self.in_row < self.limit:
            return True
        if self.policy == "skip":
            raise NonFiniteLoss(f"step {step}: {self.in_row} non-finite steps in a row "
                                f"(--nonfinite-skips {self.limit}), the last: {what}; "
                                f"stopped, the weights are those of step "
                                f"{step - self.in_row}; lower --lr or raise --warmup")
        raise NonFiniteLoss(f"step {step}: {what}; stopped before the update (the weights "
                            f"are those of step {step - 1}); lower --lr or raise --warmup, "
                            f"or --on-nonfinite skip")


def first_nonfinite(loss: float, norm: float, model: nn.Module, rank: int) -> str | None:
    """What is non-finite first: the loss, else the grad norm (naming the parameter)."""
    if not math.isfinite(loss):
        return f"the loss is {loss}" + (f" (grad norm {norm})" if not math.isfinite(norm)
                                        else "")
    if math.isfinite(norm):
        return None
    name = next((n for n, p in model.named_parameters()
                 if p.grad is not None and not bool(torch.isfinite(p.grad).all())), None)
    where = f", first in {name} on rank {rank}" if name else ""
    return f"the gradient norm is {norm} (loss {loss:.4g}{where})"
