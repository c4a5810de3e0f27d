"""Open whatever a path is, as tensors or as a model at any layout: the one way every
command (generate, convert, train --resume, verify) reads weights.

    source, config, names = open_source(path)    # a shard_io.Source of logical tensors
    model = load_model(path, mesh)               # this rank's slices, at mesh's layout
    folder = source_tokenizer(path)              # where its tokenizer files lie (checked)

`path` is a sharded checkpoint, a run folder (its latest valid checkpoint), one full
safetensors file, or a Hugging Face directory (`locate`). A model is built on the
meta device, allocated, then filled with only the slices this rank holds, read by
the split tags of its parameters (`shard_io.local_slice`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpkit.checkpoint import store
from tpkit.checkpoint.files import (
    CheckpointError,
    FullSource,
    ShardedSource,
    read_manifest,
    verify_file,
    verify_full,
)
from tpkit.checkpoint.locate import FULL, HF, SHARDED, locate
from tpkit.mesh import ParallelMesh
from tpkit.model.hf import empty_model, load_from, materialize, memory_source, open_hf_source
from tpkit.model.tokenizer import TOKENIZER_FILES, has_tokenizer
from tpkit.spec.config import ModelConfig

FULL_FORMAT = "tpkit-full"  # the "format" in a full file's metadata (`convert.to_full`)


def open_source(source: Any, config: ModelConfig | None = None
                ) -> tuple[Any, ModelConfig, set[str]]:
    """(Source, config, tensor names) of any path `locate` accepts, or of a tp=1 model or
    a dict of full tensors (with `config`)."""
    if isinstance(source, nn.Module | dict):
        return memory_source(source, config)
    found = locate(source)
    if found.kind == SHARDED:
        m = read_manifest(found.path)
        return ShardedSource(found.path, m), ModelConfig.from_dict(m["config"]), set(m["tensors"])
    if found.kind == FULL:
        return _open_full(found.path, config)
    assert found.kind == HF
    return open_hf_source(found.path)


def _open_full(path: Path, config: ModelConfig | None) -> tuple[Any, ModelConfig, set[str]]:
    src = FullSource(path)  # an unreadable file: CheckpointError naming it
    meta = json.loads((src.f.metadata() or {}).get("tpkit", "{}"))
    if meta.get("format") != FULL_FORMAT:
        raise CheckpointError(f"{path}: not a tpkit full safetensors file (no metadata)")
    verify_full(path, src, meta)
    return src, config or ModelConfig.from_dict(meta["config"]), src.names


def load_model(path: str | Path, mesh: ParallelMesh, *, dtype: torch.dtype | None = None,
               sequence_parallel: bool = False) -> nn.Module:
    """A model at `mesh`'s layout holding the weights at `path` (any kind `locate`
    accepts), each rank reading only its slices. Call on every rank of the mesh."""
    found = locate(path)
    source, config, names = open_source(found.path)
    model = empty_model(config, mesh, dtype=dtype, sequence_parallel=sequence_parallel)
    materialize(model, mesh.device)
    if found.kind == SHARDED:  # every rank stages first: nothing is half-loaded
        store.load(found.path, model, mesh=mesh)
    else:
        load_from(model, source, mesh, str(found.path))
    return model


def source_tokenizer(source: Any) -> Path | None:
    """The folder holding the tokenizer files of any path `locate` accepts (a run folder:
    its latest valid checkpoint), or None (a model, a dict, a full file, no tokenizer
    files). In a sharded checkpoint the files its manifest lists are checked against
    their sha256 first: a damaged tokenizer is a CheckpointError naming the file."""
    if isinstance(source, nn.Module | dict):
        return None
    found = locate(source)
    if not found.path.is_dir() or not has_tokenizer(found.path):
        return None
    if found.kind == SHARDED:
        files = read_manifest(found.path)["files"]
        for name in TOKENIZER_FILES:
            if name in files:
                verify_file(found.path, name, files[name])
    return found.path
