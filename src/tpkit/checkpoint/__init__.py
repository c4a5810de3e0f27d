"""Everything that reads or writes weights: a path located once into an open source,
a rank's slices read by one loop, a model built by one builder, sharded checkpoints,
optimizer state, conversion, Hugging Face import and export.

    paths.py        what a path is; a run folder's latest valid checkpoint
    sources.py      open_source(path) -> a Source; load_model(source, mesh) (`tpkit.load`)
    slices.py       Source, CheckpointError, read_local: this rank's slice of every parameter
    build.py        build_model(config, mesh, source): meta -> allocate -> load
    agree.py        every rank agrees before anything changes
    files.py        the files of a sharded checkpoint, the manifest, ShardedSource
    store.py        save / load at any layout, atomic, all ranks agreeing
    manifest.py     each rank's record, then the manifest, written last
    retention.py    the complete checkpoints of a folder; pruning the old ones safely
    codec.py        JSON with tensors (a checkpoint's `extra`), no pickle
    rng.py          the generators, captured into `extra` and restored
    optim_state.py  optimizer state per parameter (AdamW, ZeRO-1) in and out of files
    convert.py      full file, offline reshard, Hugging Face export
    hf.py           Hugging Face models in and out
    families/       the Hugging Face family adapters: pure-Python recipes, one per family
    hf_check.py     a Hugging Face model at any tp against transformers itself
    tokenizer.py    a model folder's tokenizer (Hugging Face), or tpkit's bytes; copied along

The names below resolve on first use: `tpkit.checkpoint.families` and `.tokenizer` load
without torch.
"""

__all__ = ["CheckpointError", "CheckpointWarning", "latest", "load", "load_model", "locate",
           "open_source", "save"]

_HOMES = {"CheckpointWarning": "paths", "latest": "paths", "locate": "paths",
          "CheckpointError": "slices", "load_model": "sources", "open_source": "sources",
          "load": "store", "save": "store"}


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"tpkit.checkpoint.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'tpkit.checkpoint' has no attribute {name!r}")
