"""Mixed precision with fp32 master weights (Megatron-LM's bf16 recipe; Micikevicius
et al. 2018): the forward and backward run on a bf16 copy of the model, everything
else on the fp32 model.

    fp32 model (master)                       bf16 model (compute)
      weights, AdamW state, checkpoints  -->  weights = bf16(master), cast once per step
      grads (fp32) += bf16 grad          <--  each micro-batch's backward (a hook per
      dp / tied / tp sums, norm, clip          parameter moves its bf16 gradient into the
      AdamW step                               master's fp32 sum and frees it)

Unlike autocast, the weights are not cast inside every matmul of every micro-batch,
activations are bf16 end to end (half the memory), and the gradient sum over
micro-batches is fp32. What it costs in exactness: every weight, activation and
per-micro-batch gradient is rounded to bf16 (8 bits of mantissa, relative 2^-9 per
rounding); the master weights and the optimizer are exact fp32. The bound tested
against fp32 training is on the loss: see tests/test_master_weights.py.
"""

from __future__ import annotations

import torch
from torch import nn


class MasterWeights:
    """A bf16 `compute` model fed by the fp32 `master` model (same layout, same names)."""

    def __init__(self, master: nn.Module, compute: nn.Module) -> None:
        pairs = list(zip(master.named_parameters(), compute.named_parameters()))
        for (nm, pm), (nc, pc) in pairs:
            if nm != nc or pm.shape != pc.shape:
                raise ValueError(f"master {nm} {tuple(pm.shape)} does not match compute "
                                 f"{nc} {tuple(pc.shape)}")
            if pm.dtype != torch.float32:
                raise ValueError(f"master weight {nm} is {pm.dtype}, not float32")
        self.master, self.compute = master, compute
        self.pairs = [(pm, pc) for (_, pm), (_, pc) in pairs]
        for pm, pc in self.pairs:
            if pc.requires_grad:  # not a frozen one (LoRA's base)
                pc.register_post_accumulate_grad_hook(lambda p, m=pm: _move_grad(p, m))
        self.copy_to_compute()

    @torch.no_grad()
    def copy_to_compute(self) -> None:
        """compute weights = bf16(master weights); once per step, after the optimizer."""
        for pm, pc in self.pairs:
            pc.copy_(pm)


def _move_grad(p: nn.Parameter, master: nn.Parameter) -> None:
    """Add this micro-batch's bf16 gradient to the master's fp32 sum; free it."""
    if master.grad is None:
        master.grad = p.grad.float()
    else:
        master.grad.add_(p.grad)
    p.grad = None
