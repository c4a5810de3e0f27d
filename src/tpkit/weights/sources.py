"""Open whatever a path is, once, as a source of tensors; load a model from it: the one
way every command (generate, convert, train, verify) and `tpkit.load` read weights.

    source = open_source(path)        # located once: .config, .names, .where, .read(...)
    model = load_model(source, mesh)  # this rank's slices, at mesh's layout
    folder = source_tokenizer(source) # where its tokenizer files lie (checked)

`path` is a sharded checkpoint, a run folder (its latest valid checkpoint), one full
safetensors file, or a Hugging Face directory (`locate`). The command opens it, before
any process starts; the open source is what travels to the ranks (it pickles, and each
rank opens the files again without locating or re-reading anything). A model is built
on the meta device, allocated, then filled with only the slices this rank holds
(`build.build_model`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpkit.decode.forms import for_decode
from tpkit.launch import mesh_here
from tpkit.mesh import ParallelMesh
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import CheckpointError, UserError
from tpkit.weights.build import build_model
from tpkit.weights.files import (
    FULL_FORMAT,
    ShardedSource,
    read_manifest,
    saved_config,
    verify_file,
    verify_full,
)
from tpkit.weights.hf import hf_source, memory_source
from tpkit.weights.paths import FULL, SHARDED, Located, locate
from tpkit.weights.slices import FullSource, Source
from tpkit.weights.tokenizer import TOKENIZER_FILES, ByteTokenizer, has_tokenizer, load_tokenizer


def open_source(source: Any, config: ModelConfig | None = None) -> Source:
    """The open Source of any path `locate` accepts (or of what `locate` returned), or of
    a tp=1 model or a dict of full tensors (with `config`), or of a live `transformers`
    model. An open source is returned as it is."""
    if isinstance(source, nn.Module) and not isinstance(getattr(source, "config", None),
                                                        ModelConfig):
        return hf_source(source)  # a transformers model: its tensors through its family
    if isinstance(source, nn.Module | dict):
        return memory_source(source, config)
    if not isinstance(source, str | Path | Located):
        return source
    found = source if isinstance(source, Located) else locate(source)
    if found.kind == SHARDED:
        return ShardedSource(found.path, read_manifest(found.path))
    if found.kind == FULL:
        return _open_full(found.path, config)
    return hf_source(found.path)


def _open_full(path: Path, config: ModelConfig | None) -> FullSource:
    src = FullSource(path)  # an unreadable file: CheckpointError naming it
    meta = json.loads((src.f.metadata() or {}).get("tpkit", "{}"))
    if meta.get("format") != FULL_FORMAT:
        raise CheckpointError(f"{path}: not a tpkit full safetensors file (no metadata)")
    verify_full(path, src, meta)
    src.config = config or saved_config(meta["config"], path)
    return src


def load_model(source: Any, mesh: ParallelMesh | None = None, *, tp: int | None = None,
               dtype: torch.dtype | None = None, sequence_parallel: bool = False,
               expert_parallel: bool = False, decode: bool = False,
               quantize: str | None = None) -> nn.Module:
    """The model holding the weights of `source` (an open source, any path `locate`
    accepts, or a live `transformers` model: opened here), at `mesh`'s layout, each rank
    reading only its slices. Call on every rank of the mesh. No mesh: one process, or
    (`tp`) this rank of torchrun's or `tpkit.spawn`'s processes. `expert_parallel`: a
    mixture of experts' experts spread whole over tp. BERT models keep their pooler
    (`model.pooled(h)`) if present. `decode=True`: the model only runs forward, its
    linear weights in the form this machine multiplies fastest once loaded
    (`tpkit.decode.forms.for_decode`: bfloat16 packed for oneDNN); `quantize="int8"`
    (implies decode): as int8. This is `tpkit.load`."""
    if mesh is not None and tp not in (None, mesh.tp_size):
        raise UserError(f"tp={tp} but the mesh has tp={mesh.tp_size}: give one of them")
    mesh = mesh or mesh_here(tp)
    source = open_source(source)
    model = build_model(source.config, mesh, source, dtype=dtype,
                        sequence_parallel=sequence_parallel, expert_parallel=expert_parallel)
    return for_decode(model, quantize) if decode or quantize else model


def load(source: Any, mesh: ParallelMesh | None = None, **kw) -> nn.Module:
    """`tpkit.load`: `load_model(source, mesh, **kw)`, carrying the source's tokenizer as
    `model.tokenizer` (None when it has no tokenizer files and is not a byte-level model),
    so that `model.generate("text")` returns text (`tpkit.model.text`)."""
    if mesh is None:  # a tp it cannot honour refused before anything is read
        mesh = mesh_here(kw.pop("tp", None))
    source = open_source(source)
    model = load_model(source, mesh, **kw)
    tok = load_tokenizer(source_tokenizer(source))
    model.tokenizer = None if isinstance(tok, ByteTokenizer) and \
        not model.config.byte_level else tok
    return model


def source_tokenizer(source: Any) -> Path | None:
    """The folder holding the tokenizer files of an open source (or a path: opened) that
    is a sharded checkpoint or a Hugging Face directory, or None (a model, a dict, a full file, no tokenizer
    files). In a sharded checkpoint the files its manifest lists are checked against
    their sha256 first: a damaged tokenizer is a CheckpointError naming the file."""
    source = open_source(source)
    folder = getattr(source, "root", None)
    if folder is None or not Path(folder).is_dir() or not has_tokenizer(folder):
        return None
    if isinstance(source, ShardedSource):
        files = source.manifest["files"]
        for name in TOKENIZER_FILES:
            if name in files:
                verify_file(source.root, name, files[name])
    return Path(folder)
