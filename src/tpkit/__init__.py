"""tpkit: tensor parallelism for large transformer models on PyTorch.

Splits the weight matrices *inside* each layer across devices (Megatron style),
combines the partial results with collectives that a ledger counts, composes that
with pipeline and data parallelism, and explains all of it (`tpkit quiz`).
"""

from tpkit.mesh import ParallelMesh

__all__ = ["ParallelMesh"]
__version__ = "0.1.0"
