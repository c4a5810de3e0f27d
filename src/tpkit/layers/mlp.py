"""The Megatron MLP: fc1 split by columns, fc2 split by rows (quiz answer 2).

    x [b, s, h] --f--> fc1 (column) --> act --> fc2 (row) --g--> z [b, s, h]
                       [b, s, ffn/tp]   local   [b, s, h] partial -> all-reduce

The activation is element-wise, so each rank applies it to its own columns; fc2's
rows match fc1's columns, so each rank multiplies what it already has. Forward:
one all-reduce (g). Backward: one all-reduce (f). Nothing in between.

`ColumnColumnMLP` splits both matrices by columns, the layout the quiz rejects: fc2
needs all of fc1's output, so it must be all-gathered in the middle (and again at
the end). It exists to measure why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.comm.group import CommGroup
from tpkit.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpkit.layers.sharding import seed_for
from tpkit.spec.config import ACTIVATIONS, GATED, ModelConfig


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")


def _elementwise(y: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(y)
    if activation == "gelu":
        return F.gelu(y, approximate="tanh")  # GPT-2's "gelu_new"
    return F.gelu(y) if activation == "gelu_exact" else F.relu(y)


def activate(y: torch.Tensor, activation: str) -> torch.Tensor:
    """`activation` on fc1's output [..., ffn/tp] (gated: [..., 2 ffn/tp] = [gate; up])."""
    if activation in GATED:
        gate, up = y.chunk(2, dim=-1)  # [..., ffn/tp] each
        return _elementwise(gate, GATED[activation]) * up
    return _elementwise(y, activation)


class ParallelMLP(nn.Module):
    """Column-parallel fc1 -> activation -> row-parallel fc2 (GELU, ReLU, SwiGLU, GeGLU)."""

    @classmethod
    def from_config(cls, c: ModelConfig, group: CommGroup, *, sequence_parallel: bool = False,
                    seed: int = 0, out_std: float | None = None, device=None, dtype=None
                    ) -> ParallelMLP:
        """The MLP of a transformer layer of `c`, split over `group`."""
        return cls(c.hidden, c.ffn, group, activation=c.activation, bias=c.bias,
                   sequence_parallel=sequence_parallel, init_std=c.init_std, out_std=out_std,
                   seed=seed, device=device, dtype=dtype)

    def __init__(self, hidden: int, ffn: int, group: CommGroup, *, activation: str = "gelu",
                 bias: bool = True, sequence_parallel: bool = False, init_std: float = 0.02,
                 out_std: float | None = None, seed: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__()
        _check_activation(activation)
        self.activation = activation
        gated = activation in GATED
        kw = dict(device=device, dtype=dtype)
        self.fc1 = ColumnParallelLinear(  # [gate; up] fused when gated: each part split alone
            hidden, 2 * ffn if gated else ffn, group, bias=bias,
            partition_sizes=[ffn, ffn] if gated else None, sequence_parallel=sequence_parallel,
            init_std=init_std, seed=seed_for(seed, "fc1"), **kw)
        self.fc2 = RowParallelLinear(ffn, hidden, group, bias=bias,
                                     sequence_parallel=sequence_parallel,
                                     init_std=out_std or init_std, seed=seed_for(seed, "fc2"), **kw)

    def act(self, y: torch.Tensor) -> torch.Tensor:
        """The element-wise activation on this rank's columns [b, s, ffn/tp]."""
        return activate(y, self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]; one all-reduce forward, one backward."""
        if self.activation == "swiglu" and self.fc1.decoding is not None:  # decode-only
            a = self.fc1.decoding.gated(x, self.fc1.bias)  # the gate fused, or None
            if a is not None:  # served adapters: their rows again, unfused
                served = self.fc1.served
                return self.fc2(a if served is None else served.gated(
                    x, a, lambda t: self.fc1.decoding(t, self.fc1.bias), self.act))
        y = self.fc1(x)  # [b, s, ffn/tp] (or [b, s, 2ffn/tp] fused)
        return self.fc2(self.act(y))  # [b, s, h], summed over tp


class ColumnColumnMLP(nn.Module):
    """Both matrices split by columns (quiz answer 2's wrong option), to count its traffic."""

    def __init__(self, hidden: int, ffn: int, group: CommGroup, *, activation: str = "gelu",
                 bias: bool = True, seed: int = 0) -> None:
        super().__init__()
        _check_activation(activation)
        if activation in GATED:
            raise ValueError("ColumnColumnMLP supports element-wise activations only")
        self.activation = activation
        self.fc1 = ColumnParallelLinear(hidden, ffn, group, bias=bias, gather_output=True,
                                        seed=seed_for(seed, "fc1"))
        self.fc2 = ColumnParallelLinear(ffn, hidden, group, bias=bias, gather_output=True,
                                        seed=seed_for(seed, "fc2"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]; all-gathers fc1's output before fc2 can start."""
        y = self.fc1(x)  # all-gather: [b, s, ffn] on every rank
        return self.fc2(_elementwise(y, self.activation))  # all-gather again: [b, s, h]
