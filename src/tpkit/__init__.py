"""tpkit: tensor parallelism for large transformer models on PyTorch.

Splits the weight matrices *inside* each layer across devices (Megatron style),
combines the partial results with collectives that a ledger counts, composes that
with pipeline and data parallelism, and explains all of it (`tpkit quiz`).

`import tpkit` is light: torch is imported only by the modules that need it, so
`tpkit.spec` and `tpkit.plan` run anywhere in milliseconds. `tpkit.ParallelMesh` is
the one name offered here (the documented entry point; `tpkit.launch.spawn` and
everything else live in their modules). It is resolved on first use by the module
`__getattr__` below, which is kept for that reason only: importing `tpkit.mesh` here
would import torch, and every `import tpkit.plan` runs this file first.
"""

__all__ = ["ParallelMesh"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "ParallelMesh":
        from tpkit.mesh import ParallelMesh

        return ParallelMesh
    raise AttributeError(f"module 'tpkit' has no attribute {name!r}")
