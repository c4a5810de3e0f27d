"""Tensor-parallel layers: linear (column/row), MLP, experts, attention, embeddings, loss,
norms."""

from tpkit.layers.experts import ParallelMoE
from tpkit.layers.grads import finalize_tp_grads
from tpkit.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpkit.layers.mlp import ColumnColumnMLP, ParallelMLP

__all__ = [
    "ColumnColumnMLP",
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelMoE",
    "RowParallelLinear",
    "finalize_tp_grads",
]
