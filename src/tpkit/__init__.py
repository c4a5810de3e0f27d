"""tpkit: tensor parallelism for large transformer models on PyTorch.

Splits the weight matrices *inside* each layer across devices (Megatron style),
combines the partial results with collectives that a ledger counts, composes that
with pipeline and data parallelism, and explains all of it (`tpkit quiz`).

The Python entry points (docs/python.md):

    model = tpkit.load(path)                   # one process: the whole model
    model = tpkit.load(path, mesh)             # this rank's shard, at mesh's layout
    tokens = model.generate(ids, max_new_tokens=16)
    text = model.generate("a prompt", max_new_tokens=16)   # with the tokenizer it carries
    results = tpkit.spawn(fn, 2, path)         # fn(mesh, path) on 2 local ranks (tp=2)
    mine = tpkit.parallelize(module, mesh, {"*.fc1": "colwise", "*.fc2": "rowwise"})

`path` is a tpkit checkpoint, a run folder (its latest valid checkpoint), a full
.safetensors file or a Hugging Face directory. `import tpkit` is light: torch is
imported only by the modules that need it, so `tpkit.spec` and `tpkit.plan` run
anywhere in milliseconds. The names below are resolved on first use by the module
`__getattr__`, which is kept for that reason only: importing them here would import
torch, and every `import tpkit.plan` runs this file first; `__dir__` lists them, so
`dir(tpkit)` and tab completion show them without importing anything.
"""

__all__ = ["ParallelMesh", "load", "parallelize", "spawn"]
__version__ = "0.1.0"

from tpkit.spec.lazy import lazy_names  # noqa: E402 (pure Python, no torch)

__getattr__, __dir__ = lazy_names("tpkit", {  # public name -> (module, name in it)
    "ParallelMesh": ("tpkit.mesh", "ParallelMesh"),
    "load": ("tpkit.weights.sources", "load"),
    "parallelize": ("tpkit.parallel.parallelize", "parallelize"),
    "spawn": ("tpkit.launch", "spawn_ranks"),
}, globals())
