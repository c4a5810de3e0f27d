"""Checkpoints: save, load, the manifest, optimizer state, conversion, and opening
whatever a path is (a checkpoint, a run folder, a full file, a Hugging Face folder).

    files.py        the files of a sharded checkpoint, the manifest, reading any slice
    store.py        save / load at any layout, atomic, all ranks agreeing
    optim_state.py  optimizer state per parameter (AdamW, ZeRO-1) in and out of files
    locate.py       what a path is; a run folder's latest valid checkpoint
    sources.py      open_source(path), load_model(path, mesh): how every command reads
    convert.py      full file, offline reshard, Hugging Face export
"""

from tpkit.checkpoint.files import CheckpointError
from tpkit.checkpoint.locate import CheckpointWarning, latest, locate
from tpkit.checkpoint.sources import load_model, open_source
from tpkit.checkpoint.store import load, save

__all__ = ["CheckpointError", "CheckpointWarning", "latest", "load", "load_model", "locate",
           "open_source", "save"]
