"""Checkpoints to and from one full safetensors file, offline resharding, Hugging Face
export: in one process, without a process per rank (`tpkit convert` is the command).

    to_full("runs/demo", "model.safetensors")       # logical tensors (a run folder: latest)
    reshard("model.safetensors", "ckpt-tp4", tp=4, pp=2)
    reshard("runs/ckpt/step-100", "ckpt-tp1", tp=1)  # + optimizer state
    to_hf("runs/ckpt/step-100", "hf-out")            # a directory transformers loads

Resharding builds the model of each target coordinate on the meta device over a
`ParallelMesh.virtual` (no processes, no memory, no init), reads its split tags, and
asks the source for exactly those slices (`slices.read_local`): the tags, never
the names, decide the layout.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn

from tpkit.checkpoint.build import empty_model
from tpkit.checkpoint.files import ShardedSource, rank_file, tensors_digest, verify_file
from tpkit.checkpoint.hf import write_hf
from tpkit.checkpoint.manifest import write_manifest, write_record
from tpkit.checkpoint.optim_state import keys_by_param
from tpkit.checkpoint.slices import read_local
from tpkit.checkpoint.sources import FULL_FORMAT, open_source, source_tokenizer
from tpkit.checkpoint.tokenizer import copy_tokenizer, export_tokenizer
from tpkit.layers.sharding import split_of
from tpkit.mesh import ParallelMesh
from tpkit.spec.config import ModelConfig


def meta_model(config: ModelConfig, tp: int, pp: int, rank: int) -> nn.Module:
    """The model of one rank of a (tp, pp) layout on the meta device (names, shapes,
    split tags only), over a mesh with no processes behind it."""
    return empty_model(config, ParallelMesh.virtual(tp, pp, rank=rank))


def to_hf(source: Any, out_dir: str | Path, config: ModelConfig | None = None) -> Path:
    """A Hugging Face directory from any source `open_source` takes (a path, an open
    source, a tp=1 model or a dict); with the source's tokenizer files (or, for a tpkit
    preset, a byte-level tokenizer)."""
    src = open_source(source, config)
    out = write_hf(src, out_dir)
    export_tokenizer(source_tokenizer(src), out, src.config.name)
    return out


def to_full(source: Any, out: str | Path) -> Path:
    """Write every logical tensor (no padding, tied copies once) into one safetensors file."""
    src = open_source(source)
    config, names = src.config, src.names
    tensors = {}
    for n in sorted(names):
        shape = src.logical_shape(n)
        tensors[n] = (src.read(n, 0, 0, shape[0]) if shape else src.read(n, 0, 0, 1)
                      ).contiguous().clone()
    step = src.manifest["step"] if isinstance(src, ShardedSource) else 0
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(format=FULL_FORMAT, config=config.to_dict(), step=step,
                sha256=tensors_digest(tensors))
    tmp = out.parent / f".{out.name}.tmp"  # never a half-written file under `out`'s name
    save_file(tensors, str(tmp), metadata={"tpkit": json.dumps(meta)})
    os.replace(tmp, out)
    return out




def reshard(source: Any, out: str | Path, tp: int, pp: int = 1) -> Path:
    """Write a sharded checkpoint at (tp, pp) from any source; optimizer state follows
    when the source is a sharded checkpoint that has it. Atomic like `checkpoint.save`."""
    src = open_source(source)
    config = src.config
    config.check(tp=tp, pp=pp)
    m = src.manifest if isinstance(src, ShardedSource) else None
    optim_src = ShardedSource(src.root, m, "optim") if m and m.get("optimizer") else None
    root = Path(out)
    tmp = root.parent / f".{root.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    extra = _rank0_extra(src.root, m) if m else {}
    for p in range(pp):
        for t in range(tp):
            rank = p * tp + t  # tp innermost, like every mesh
            model = meta_model(config, tp, pp, rank)
            params = _slices(src, model)
            optim = _optim_slices(optim_src, model) if optim_src else {}
            groups = m["optimizer"]["groups"] if optim_src else None
            write_record(tmp, model.mesh, config, params=params, optim=optim, groups=groups,
                         extra=extra)
    folder = source_tokenizer(src)
    if folder is not None:  # the tokenizer travels along, listed in the manifest
        copy_tokenizer(folder, tmp)
    write_manifest(tmp, root, config.to_dict(), m["optimizer"]["type"] if optim_src else None,
                   m["step"] if m else 0, dict(tp=tp, pp=pp, dp=1))
    return root


def _slices(src, model: nn.Module) -> dict:
    """name -> (this coordinate's slice, split) of every parameter its stage owns."""
    params = dict(model.named_parameters())
    return {n: (x, split_of(params[n]))
            for n, x in read_local(model, src, model.mesh, own_only=True).items()}


def _optim_slices(src: ShardedSource, model: nn.Module) -> dict:
    """"{param}::{key}" -> (this coordinate's slice, split or None for a scalar)."""
    params = dict(model.named_parameters())
    staged = read_local(model, src, model.mesh, own_only=True,
                        state_keys=keys_by_param(src.manifest["optim_tensors"]))
    return {k: (x, split_of(params[k.split("::", 1)[0]]) if x.dim() else None)
            for k, x in staged.items()}


def _rank0_extra(root: Path, m: dict) -> dict:
    name = rank_file(0)
    return json.loads(verify_file(root, name, m["files"].get(name)).read_text())["extra"]
