"""Hugging Face models in and out: GPT-2, Llama family (GQA, Mistral-style), BERT encoders.

    model = from_pretrained("path/to/hf-dir", mesh)   # each rank reads only its slices
    to_hf(model, "out-dir")                           # a directory `transformers` loads
    tpkit.checkpoint.convert.to_hf(checkpoint_dir, "out-dir")   # the same from a checkpoint

The name table and the configs live in `hf_map` (pure Python). Every tpkit parameter is
made of Hugging Face tensors, in tpkit's [out, in] layout:

    layers.{i}.attn.qkv.weight  = [q_proj; k_proj; v_proj]      (Llama, BERT)
                                = c_attn.weight^T               (GPT-2, already fused)
    layers.{i}.mlp.fc1.weight   = [gate_proj; up_proj]          (SwiGLU)

`HFSource` serves the rows a rank needs (`tpkit.shard_io.local_slice`) with safetensors
`get_slice`, so no process reads the whole model.

BERT is a post-norm encoder (`pre_norm=False`: no final norm) with an embedding
LayerNorm (`embed_norm=True`) and exact erf GELU (`activation="gelu_exact"`);
`build_model` adds its optional pooler.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tpkit.mesh import ParallelMesh
from tpkit.model.hf_map import (  # noqa: F401 - part of this module's interface
    Recipe,
    bert_style,
    config_from_hf,
    config_to_hf,
    family_of,
    table,
)
from tpkit.model.names import EMBED_WEIGHT, POOLER_WEIGHT
from tpkit.shard_io import CheckpointError, DictSource, local_slice
from tpkit.sharding import meta_of, split_of
from tpkit.spec.config import ModelConfig

CONFIG_FILE = "config.json"  # what makes a directory a Hugging Face model

# -- reading ----------------------------------------------------------------------------
class HFSource:
    """A `shard_io.Source` over Hugging Face tensors (safetensors files or a state dict)."""

    def __init__(self, tensors: Any, recipes: dict[str, Recipe], where: str) -> None:
        self.tensors, self.recipes, self.where = tensors, recipes, where
        keys = set(tensors.keys())
        base = recipes[EMBED_WEIGHT][0][0]
        self.prefix = next((p for p in ("", "transformer.", "model.", "bert.")
                            if p + base in keys), None)
        if self.prefix is None:
            raise CheckpointError(f"{where}: no {base!r} among its tensors")
        self.keys = keys

    def _key(self, k: str) -> str:
        return k[1:] if k.startswith("@") else self.prefix + k

    def _shape(self, key: str, tr: bool) -> list[int]:
        t = self.tensors[key]
        shape = list(t.get_shape() if hasattr(t, "get_shape") else t.shape)
        return shape[::-1] if tr else shape

    def logical_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape in tpkit's layout (None when the model lacks it, e.g. no pooler)."""
        if name not in self.recipes:
            return None
        keys, tr = self.recipes[name]
        if any(self._key(k) not in self.keys for k in keys):
            return None
        shapes = [self._shape(self._key(k), tr) for k in keys]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along `dim` of the tpkit tensor, read piece by piece."""
        keys, tr = self.recipes[name]
        pieces, offset = [], 0
        for k in keys:
            key = self._key(k)
            n = self._shape(key, tr)[0]
            if dim == 0:
                lo, hi = max(start, offset), min(stop, offset + n)
                if lo < hi:
                    pieces.append(self._get(key, tr, 0, lo - offset, hi - offset))
            else:
                pieces.append(self._get(key, tr, dim, start, stop))
            offset += n
        return torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]

    def _get(self, key: str, tr: bool, dim: int, a: int, b: int) -> torch.Tensor:
        t = self.tensors[key]
        hf_dim = (1 - dim) if tr else dim
        x = t[(slice(None),) * hf_dim + (slice(a, b),)]
        return x.T if tr else x


class _SafetensorsDir:
    """Key -> get_slice object over model.safetensors or its sharded index."""

    def __init__(self, root: Path) -> None:
        index = root / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
            if index.is_file() else ["model.safetensors"]
        self.map: dict[str, Any] = {}
        for f in files:
            if not (root / f).is_file():
                raise CheckpointError(f"{root / f}: missing (only safetensors are read; "
                                      f"convert pytorch_model.bin with transformers first)")
            h = safe_open(str(root / f), framework="pt")
            self.map.update({k: h for k in h.keys()})

    def keys(self):
        return self.map.keys()

    def __getitem__(self, key: str):
        return self.map[key].get_slice(key)


def open_hf(path_or_model: Any) -> tuple[dict, Any, str]:
    """(config dict, tensors, description) of a Hugging Face directory or live model."""
    if isinstance(path_or_model, (str, Path)):
        root = Path(path_or_model)
        if not (root / CONFIG_FILE).is_file():
            raise CheckpointError(f"{root / CONFIG_FILE}: missing: not a Hugging Face model "
                                  f"directory")
        return json.loads((root / CONFIG_FILE).read_text()), _SafetensorsDir(root), str(root)
    sd = {k: v.detach() for k, v in path_or_model.state_dict().items()}
    return path_or_model.config.to_dict(), sd, type(path_or_model).__name__


def from_pretrained(path_or_model: Any, mesh: ParallelMesh | None = None, *,
                    dtype: torch.dtype | None = None, sequence_parallel: bool = False
                    ) -> nn.Module:
    """A tpkit Transformer holding a Hugging Face model's weights, this rank's slices only.

    `path_or_model`: a local directory (config.json + safetensors) or a loaded
    `transformers` model. BERT models keep their pooler as `model.pooler` if present.
    """
    mesh = mesh or ParallelMesh.single()
    source, config, names = open_hf_source(path_or_model)
    model = empty_model(config, mesh, names, dtype=dtype, sequence_parallel=sequence_parallel)
    materialize(model, mesh.device)
    load_from(model, source, mesh, source.where)
    return model


def open_hf_source(path_or_model: Any) -> tuple[HFSource, ModelConfig, set[str]]:
    """(Source, config, tpkit tensor names present) of a Hugging Face directory or model."""
    hf, tensors, where = open_hf(path_or_model)
    fam, config = config_from_hf(hf)
    source = HFSource(tensors, table(fam, config), where)
    return source, config, {n for n in source.recipes if source.logical_shape(n) is not None}


def load_from(model: nn.Module, source: Any, mesh: ParallelMesh, where: str) -> None:
    """Copy this rank's slice of every parameter out of `source` (staged, then copied)."""
    staged = {}
    for name, p in model.named_parameters():
        src = meta_of(p).tied_to or name
        staged[name] = local_slice(source, src, split_of(p), mesh.tp_rank, mesh.tp_size,
                                   tuple(p.shape), where).to(p.dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(staged[name])


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a meta-built model on `device`, keeping the parameters' split tags."""
    tags = {n: dict(vars(p)) for n, p in model.named_parameters()}
    model.to_empty(device=device)
    for n, p in model.named_parameters():
        vars(p).update(tags[n])
    return model


# -- building ---------------------------------------------------------------------------
def build_model(config: ModelConfig, mesh: ParallelMesh, *, pooler: bool = False,
                **kw) -> nn.Module:
    """`Transformer(config, mesh, **kw)`, with BERT's pooler (`model.pooler`) if asked."""
    from tpkit.model.transformer import Transformer

    model = Transformer(config, mesh, **kw)
    if pooler and bert_style(config) and model.is_last_stage:
        dev = {k: v for k, v in kw.items() if k in ("device", "dtype")}
        dev.setdefault("device", mesh.device)
        model.pooler = nn.Linear(config.hidden, config.hidden, **dev)
    return model


def empty_model(config: ModelConfig, mesh: Any, names: set[str], **kw) -> nn.Module:
    """The model whose tensors are `names` (BERT's pooler if among them) on the meta
    device, at `mesh`'s coordinate: names, shapes and split tags, no memory."""
    return build_model(config, mesh, device="meta", pooler=POOLER_WEIGHT in names, **kw)


def pooled(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """BERT's pooler output tanh(W h[:, 0] + b) [b, h] from final hidden states."""
    return torch.tanh(model.pooler(hidden[:, 0]))


def memory_source(source: Any, config: ModelConfig | None = None
                  ) -> tuple[DictSource, ModelConfig, set[str]]:
    """(Source, config, names) over a tp=1 model or a dict of full tensors (padding cut)."""
    if isinstance(source, dict):
        if config is None:
            raise ValueError("a dict of tensors needs its ModelConfig")
        return DictSource(source), config, set(source)
    if source.mesh.tp_size * source.mesh.pp_size != 1:
        raise ValueError("to_hf(model) needs a tp=1, pp=1 model; save a checkpoint and "
                         "export that with `tpkit convert --to hf` instead")
    full = {n: p.detach()[:meta_of(p).logical_size or p.shape[0]]
            for n, p in source.named_parameters() if not meta_of(p).tied_to}
    return DictSource(full), source.config, set(full)


def to_hf(source: Any, out_dir: str | Path, config: ModelConfig | None = None) -> Path:
    """Write a Hugging Face directory (config.json + model.safetensors) from a tp=1 model
    or a dict of full tensors. (`tpkit.checkpoint.convert.to_hf` also takes checkpoints.)"""
    return write_hf(*memory_source(source, config), out_dir)


def write_hf(src: Any, config: ModelConfig, names: set[str], out_dir: str | Path) -> Path:
    """Write a Hugging Face directory from any `Source` of full logical tensors."""
    fam, out = family_of(config), Path(out_dir)
    prefix = {"gpt2": "transformer.", "llama": "model.", "bert": ""}[fam]
    tensors = {}
    for name, (keys, tr) in table(fam, config).items():
        if name not in names:
            continue
        shape = src.logical_shape(name)
        full = src.read(name, 0, 0, shape[0]) if shape else src.read(name, 0, 0, 1)
        offset = 0
        for k in keys:
            part = full.narrow(0, offset, _piece_rows(fam, config, k, full.shape[0] // len(keys)))
            offset += part.shape[0]
            tensors[k[1:] if k.startswith("@") else prefix + k] = \
                (part.T if tr else part).contiguous().clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config_to_hf(config), indent=1))
    return out


def _piece_rows(fam: str, c: ModelConfig, key: str, even: int) -> int:
    """Rows of one Hugging Face piece of a fused tpkit tensor (k/v smaller under GQA)."""
    if fam == "llama" and (".k_proj" in key or ".v_proj" in key):
        return c.kv_heads * c.head_dim
    if fam == "llama" and ".q_proj" in key:
        return c.num_heads * c.head_dim
    return even
