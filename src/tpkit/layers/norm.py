"""LayerNorm and RMSNorm, replicated over tp.

Without sequence parallelism every tp rank normalizes the same [b, s, h] activations
(redundant, cheap). With it, each rank normalizes its own [b, s/tp, h] slice, so the
weight gradient on each rank is a partial sum: the weights are tagged and
`finalize_tp_grads` sums them over tp.

`offset` scales by (offset + weight): Gemma stores w and normalizes with (1 + w).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.layers.sharding import set_meta
from tpkit.spec.config import NORMS


class Norm(nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight) over the last dimension."""

    def __init__(self, hidden: int, kind: str = "layernorm", eps: float = 1e-5, *,
                 sequence_parallel: bool = False, offset: float = 0.0, device=None,
                 dtype=None) -> None:
        super().__init__()
        if kind not in NORMS:
            raise ValueError(f"norm={kind!r} is not one of {NORMS}")
        self.kind, self.eps, self.hidden, self.offset = kind, eps, hidden, offset
        self.weight = nn.Parameter(torch.full((hidden,), 1.0 - offset, device=device,
                                              dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden, device=device, dtype=dtype)) \
            if kind == "layernorm" else None
        for p in self.parameters():
            set_meta(p, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., h] -> [..., h]."""
        w = self.weight + self.offset if self.offset else self.weight  # [h]
        if self.kind == "layernorm":
            return F.layer_norm(x, (self.hidden,), w, self.bias, self.eps)
        return F.rms_norm(x, (self.hidden,), w, self.eps)  # torch's fused kernel

    def extra_repr(self) -> str:
        return f"{self.kind}, hidden={self.hidden}, eps={self.eps}, offset={self.offset}"
