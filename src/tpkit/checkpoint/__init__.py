"""Run checkpoints: what `tpkit train` writes and resumes from, and what `tpkit convert`
turns it into. Reading model weights (locating a path, reading a rank's slices, building
the model, Hugging Face import and export) is `tpkit.weights`, below this package.

    store.py        save / load at any layout, atomic, all ranks agreeing
    manifest.py     each rank's record, then the manifest (the run id), written last
    retention.py    the complete checkpoints of a folder; pruning the old ones safely
    optim_state.py  optimizer state per parameter (AdamW, ZeRO-1) in and out of files
    codec.py        JSON with tensors (a checkpoint's `extra`), no pickle
    rng.py          the generators, captured into `extra` and restored
    convert.py      full file, offline reshard, Hugging Face export
    dest.py         where a checkpoint or an export may be written (never over foreign files)
    disk.py         writing with a full disk named, not a traceback
    finite.py       a NaN or inf parameter, found before it is saved

The format of a sharded checkpoint's files (`tpkit.weights.files`) lives with the
readers, since loading weights reads it; this package writes it.

The names below resolve on first use (nothing here imports torch); the errors are
`tpkit.spec.errors`', the readers `tpkit.weights`'.
"""

__all__ = ["CheckpointError", "CheckpointWarning", "latest", "load", "load_model", "locate",
           "open_source", "save"]

from tpkit.spec.lazy import lazy_names  # noqa: E402 (pure Python: no torch yet)
from tpkit.weights import HOMES as _WEIGHTS  # noqa: E402 (names only, nothing imported)

__getattr__, __dir__ = lazy_names("tpkit.checkpoint", {  # name -> the module defining it
    **_WEIGHTS,
    "load": "tpkit.checkpoint.store",
    "save": "tpkit.checkpoint.store",
}, globals())
