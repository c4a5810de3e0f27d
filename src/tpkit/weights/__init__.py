"""What reads model weights: a path located once into an open source, a rank's slices
read by one loop, a model built by one builder (`tpkit.load`), Hugging Face import and
export. Run checkpoints (save, resume, retention, convert) are `tpkit.checkpoint`, above.

    paths.py        what a path is; a run folder's latest valid checkpoint
    sources.py      open_source(path) -> a Source; load_model(source, mesh) (`tpkit.load`)
    slices.py       Source, read_local: this rank's slice of every parameter
    build.py        build_model(config, mesh, source): meta -> allocate -> load
    agree.py        every rank agrees before anything changes
    files.py        the files of a sharded checkpoint, the manifest, ShardedSource
    finite.py       NaN or inf in weights: refused in checkpoints, warned of on load
    hf.py           Hugging Face models in and out; hf_config: a config.json read
    families/       the Hugging Face family adapters: pure-Python recipes, one per family
    hf_check.py     a Hugging Face model at any tp against transformers itself
    tokenizer.py    a model folder's tokenizer (Hugging Face), or tpkit's bytes; copied along

The names below resolve on first use: `tpkit.weights.families` and `.tokenizer` load
without torch. `CheckpointError` is `tpkit.spec.errors`'.
"""

__all__ = ["CheckpointError", "CheckpointWarning", "latest", "load_model", "locate",
           "open_source"]

from tpkit.spec.lazy import lazy_names  # noqa: E402 (pure Python: no torch yet)

HOMES = {  # name -> the module defining it (tpkit.checkpoint re-exports them)
    "CheckpointError": "tpkit.spec.errors",
    "CheckpointWarning": "tpkit.spec.errors",
    "latest": "tpkit.weights.paths",
    "locate": "tpkit.weights.paths",
    "load_model": "tpkit.weights.sources",
    "open_source": "tpkit.weights.sources",
}
__getattr__, __dir__ = lazy_names("tpkit.weights", HOMES, globals())
