"""Checkpoints to and from one full safetensors file, offline resharding, Hugging Face
export: in one process, without a process per rank (`tpkit convert` is the command).

    to_full("runs/demo", "model.safetensors")       # logical tensors (a run folder: latest)
    reshard("model.safetensors", "ckpt-tp4", tp=4, pp=2)
    reshard("runs/ckpt/step-100", "ckpt-tp1", tp=1)  # + optimizer state
    to_hf("runs/ckpt/step-100", "hf-out")            # a directory transformers loads
    to_hf(model, "hf-out", overwrite=True)           # replacing an earlier export
    to_peft("runs/lora", "adapter")                  # LoRA: PEFT's adapter folder
    to_hf("runs/lora", "merged", merge=True)         # LoRA: folded into the weights

Each writes a new name or an empty folder, or replaces (`overwrite`) tpkit's own
artifact of the same kind, through a hidden temporary renamed into place; never into,
around or over its source (`checkpoint.dest`).

Resharding builds the model of each target coordinate on the meta device over a
`ParallelMesh.virtual` (no processes, no memory, no init), reads its split tags, and
asks the source for exactly those slices (`slices.read_local`): the tags, never
the names, decide the layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn

from tpkit.checkpoint.dest import new_artifact
from tpkit.checkpoint.manifest import write_manifest, write_record
from tpkit.checkpoint.optim_state import keys_by_param
from tpkit.layers.sharding import split_of
from tpkit.mesh import ParallelMesh
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import UserError
from tpkit.weights.build import empty_model
from tpkit.weights.files import (
    FULL_FORMAT,
    ShardedSource,
    rank_file,
    tensors_digest,
    verify_file,
)
from tpkit.weights.hf import write_hf
from tpkit.weights.paths import FULL, HF, PEFT, SHARDED
from tpkit.weights.peft import merged_source, write_peft
from tpkit.weights.slices import read_local
from tpkit.weights.sources import open_source, source_tokenizer
from tpkit.weights.tokenizer import copy_tokenizer, export_tokenizer


def meta_model(config: ModelConfig, tp: int, pp: int, rank: int) -> nn.Module:
    """The model of one rank of a (tp, pp) layout on the meta device (names, shapes,
    split tags only), over a mesh with no processes behind it."""
    return empty_model(config, ParallelMesh.virtual(tp, pp, rank=rank))


def to_hf(source: Any, out_dir: str | Path, config: ModelConfig | None = None, *,
          overwrite: bool = False, merge: bool = False) -> Path:
    """A Hugging Face directory from any source `open_source` takes (a path, an open
    source, a tp=1 model or a dict); with the source's tokenizer files (or, for a tpkit
    preset, a byte-level tokenizer). LoRA adapters (`merge`): folded into their weights."""
    src = open_source(source, config)
    tokenizer, origins = source_tokenizer(src), _origins(source, src)
    if src.config.lora_rank and not merge:
        raise UserError(f"{src.where}: holds LoRA adapters: --to hf --merge writes the "
                        f"model with them folded in, --to peft the adapters alone")
    model = merged_source(src) if merge else src
    with new_artifact(out_dir, HF, overwrite=overwrite, sources=origins) as tmp:
        write_hf(model, tmp)
        export_tokenizer(tokenizer, tmp, src.config.name)
    return Path(out_dir)


def to_peft(source: Any, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """PEFT's adapter folder (`peft.PeftModel.from_pretrained(model, out_dir)`) of the
    LoRA adapters of a checkpoint, full file or run folder."""
    src = open_source(source)
    with new_artifact(out_dir, PEFT, overwrite=overwrite, sources=_origins(source, src)) as tmp:
        write_peft(src, tmp)
    return Path(out_dir)


def to_full(source: Any, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write every logical tensor (no padding, tied copies once) into one safetensors file."""
    src = open_source(source)
    with new_artifact(out, FULL, overwrite=overwrite, sources=_origins(source, src)) as tmp:
        tensors = {}
        for n in sorted(src.names):
            shape = src.logical_shape(n)
            tensors[n] = (src.read(n, 0, 0, shape[0]) if shape else src.read(n, 0, 0, 1)
                          ).contiguous().clone()
        step = src.manifest["step"] if isinstance(src, ShardedSource) else 0
        meta = dict(format=FULL_FORMAT, config=src.config.to_dict(), step=step,
                    sha256=tensors_digest(tensors))
        save_file(tensors, str(tmp), metadata={"tpkit": json.dumps(meta)})
    return Path(out)


def _origins(source: Any, src) -> list[Path]:
    """The path a conversion reads (a run folder: its checkpoint, so that a destination
    beside it in the run folder is fine, one holding it is not)."""
    found = getattr(src, "root", None) or getattr(src, "path", None)
    return [Path(found)] if isinstance(found, str | Path) else []


def reshard(source: Any, out: str | Path, tp: int, pp: int = 1, *,
            overwrite: bool = False) -> Path:
    """Write a sharded checkpoint at (tp, pp) from any source; optimizer state follows
    when the source is a sharded checkpoint that has it. Atomic like `checkpoint.save`."""
    src = open_source(source)
    config = src.config
    config.check(tp=tp, pp=pp)
    m = src.manifest if isinstance(src, ShardedSource) else None
    optim_src = ShardedSource(src.root, m, "optim") if m and m.get("optimizer") else None
    with new_artifact(out, SHARDED, overwrite=overwrite, sources=_origins(source, src)) as tmp:
        extra = _rank0_extra(src.root, m) if m else {}
        for p in range(pp):
            for t in range(tp):
                rank = p * tp + t  # tp innermost, like every mesh
                model = meta_model(config, tp, pp, rank)
                params = _slices(src, model)
                optim = _optim_slices(optim_src, model) if optim_src else {}
                groups = m["optimizer"]["groups"] if optim_src else None
                write_record(tmp, model.mesh, config, params=params, optim=optim,
                             groups=groups, extra=extra)
        folder = source_tokenizer(src)
        if folder is not None:  # the tokenizer travels along, listed in the manifest
            copy_tokenizer(folder, tmp)
        write_manifest(tmp, config.to_dict(), m["optimizer"]["type"] if optim_src else None,
                       m["step"] if m else 0, dict(tp=tp, pp=pp, dp=1))
    return Path(out)


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
