"""tpkit: tensor parallelism for large transformer models on PyTorch.

Splits the weight matrices *inside* each layer across devices (Megatron style),
combines the partial results with collectives that a ledger counts, composes that
with pipeline and data parallelism, and explains all of it (`tpkit quiz`).

`import tpkit` is light: torch is imported only by the modules that need it, so
`tpkit.plan` and `tpkit.spec.config` run anywhere in milliseconds.
"""

__all__ = ["ParallelMesh", "spawn"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "ParallelMesh":
        from tpkit.mesh import ParallelMesh

        return ParallelMesh
    if name == "spawn":
        from tpkit.launch import spawn

        return spawn
    raise AttributeError(f"module 'tpkit' has no attribute {name!r}")
