"""Hugging Face models in and out, for every family of `tpkit.weights.families`.

    model = tpkit.load("path/to/hf-dir", mesh)        # each rank reads only its slices
    tpkit.checkpoint.convert.to_hf(model_or_checkpoint, "out-dir")  # transformers loads it

The family adapters (pure Python) say how a config.json maps to a `ModelConfig` and
which rows of which Hugging Face tensors make each tpkit parameter (a `Recipe` of
`Cut`s: whole tensors stacked, a fused tensor read as is, or per-head rows).
`HFSource` serves the rows a rank needs (`slices.read_local`) with
safetensors `get_slice`, so no process reads the whole model; `write_hf` puts every
row back where the recipe took it from, so an export is bit-identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tpkit.layers.sharding import meta_of
from tpkit.model.names import EMBED_WEIGHT
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import CheckpointError
from tpkit.weights.families import (
    Cut,
    Family,
    Recipe,
    config_from_hf,
    for_model_type,
    of_config,
    with_family,
)
from tpkit.weights.slices import DictSource, open_safetensors

CONFIG_FILE = "config.json"  # what makes a directory a Hugging Face model
HF_WEIGHTS = "model.safetensors"  # the one weights file of an export
MARK = ("written_by", "tpkit")  # in an export's safetensors metadata: tpkit's own

# -- reading ----------------------------------------------------------------------------
class HFSource:
    """A `slices.Source` over Hugging Face tensors (safetensors files or a state dict)."""

    def __init__(self, tensors: Any, family: Family, recipes: dict[str, Recipe],
                 where: str, config: ModelConfig | None = None) -> None:
        self.tensors, self.recipes, self.where, self.family = tensors, recipes, where, family
        self.config, self.keys = config, set(tensors.keys())
        self.root = getattr(tensors, "root", None)  # a directory's (its tokenizer files)
        base = recipes[EMBED_WEIGHT].cuts[0].key
        self.prefix = next((p for p in family.prefixes if p + base in self.keys), None)
        if self.prefix is None:
            raise CheckpointError(f"{where}: no {base!r} among its tensors (prefixes tried: "
                                  f"{list(family.prefixes)})")
        self.names = {n for n in recipes if self.logical_shape(n) is not None}
        self._extent = {}  # key -> rows its cuts span, in every recipe (fused tensors)
        for c in (c for rec in recipes.values() for c in rec.cuts if c.rows is not None):
            self._extent[c.key] = max(self._extent.get(c.key, 0), c.start + c.rows)

    def _key(self, k: str) -> str:
        return k[1:] if k.startswith("@") else self.prefix + k

    def _rows(self, cut: Cut, tr: bool) -> int:
        if cut.rows is not None:
            return cut.rows
        t = self.tensors[self._key(cut.key)]
        shape = list(t.get_shape() if hasattr(t, "get_shape") else t.shape)
        return shape[-1] if tr else shape[0]

    def _shape(self, cut: Cut, tr: bool) -> list[int]:
        t = self.tensors[self._key(cut.key)]
        shape = list(t.get_shape() if hasattr(t, "get_shape") else t.shape)
        return [self._rows(cut, tr), *(shape[::-1] if tr else shape)[1:]]

    def logical_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape in tpkit's layout (None when the model lacks it)."""
        if name not in self.recipes:
            return None
        r = self.recipes[name]
        if any(self._key(c.key) not in self.keys for c in r.cuts):
            return None
        shapes = [self._shape(c, r.transposed) for c in r.cuts]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def missing(self, name: str) -> str:
        """The file's tensors that tpkit tensor `name` needs and this model lacks."""
        gone = [self._key(c.key) for c in self.recipes[name].cuts
                if self._key(c.key) not in self.keys] if name in self.recipes else []
        return (f"no tensor {', '.join(map(repr, gone))} (tpkit's {name})" if gone
                else f"has no tensor {name!r}")

    def shape_problem(self, name: str, want: tuple[int, ...]) -> str | None:
        """The first of the file's tensors behind tpkit tensor `name` (of logical shape
        `want`) whose shape cannot make it: its name and shape as in the file, and the
        shape the config implies; None when every one fits."""
        r = self.recipes[name]
        fixed = sum(c.rows for c in r.cuts if c.rows is not None)
        for cut in r.cuts if want else ():
            key = self._key(cut.key)
            t = self.tensors[key]
            have = list(t.get_shape() if hasattr(t, "get_shape") else t.shape)
            rows = want[0] - fixed if cut.rows is None else self._extent[cut.key]
            expect = [rows, *want[1:]][::-1] if r.transposed else [rows, *want[1:]]
            if have != expect:
                return (f"tensor {key!r} has shape {have}, the model ({self.where}'s "
                        f"config) expects {expect}")
        return None

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along `dim` of the tpkit tensor, read cut by cut."""
        r = self.recipes[name]
        pieces, offset = [], 0
        for cut in r.cuts:
            n = self._rows(cut, r.transposed)
            if dim != 0:
                pieces.append(self._get(cut, r.transposed, dim, start, stop, 0, n))
            elif max(start, offset) < min(stop, offset + n):
                lo, hi = max(start, offset) - offset, min(stop, offset + n) - offset
                pieces.append(self._get(cut, r.transposed, 0, lo, hi, lo, hi))
            offset += n
        return torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]

    def _get(self, cut: Cut, tr: bool, dim: int, a: int, b: int, r0: int, r1: int
             ) -> torch.Tensor:
        """[a, b) along tpkit `dim` of the cut's rows [r0, r1) (rows of the HF tensor
        counted from the cut's start)."""
        t = self.tensors[self._key(cut.key)]
        rows = slice(cut.start + r0, cut.start + r1)
        if dim == 0:
            x = t[:, rows] if tr else t[rows]
        else:  # rows of the cut, columns [a, b)
            x = t[slice(a, b), rows] if tr else t[rows, slice(a, b)]
        return x.T if tr else x


class _SafetensorsDir:
    """Key -> get_slice object over model.safetensors or its sharded index."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.map = self._open(root)

    @staticmethod
    def _open(root: Path) -> dict[str, Any]:
        index = root / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
            if index.is_file() else ["model.safetensors"]
        found: dict[str, Any] = {}
        for f in files:
            if not (root / f).is_file():
                raise CheckpointError(f"{root / f}: missing (only safetensors are read; "
                                      f"convert pytorch_model.bin with transformers first)")
            h = open_safetensors(root / f)  # truncated or foreign: one line naming it
            found.update({k: h for k in h.keys()})
        return found

    def __getstate__(self) -> dict:  # picklable (to the ranks): the files are opened again
        return dict(root=self.root)

    def __setstate__(self, state: dict) -> None:
        self.root = state["root"]
        self.map = self._open(self.root)

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
        hf = read_config_json(root / CONFIG_FILE)
        for_model_type(hf.get("model_type"))  # an unsupported family before missing files
        return hf, _SafetensorsDir(root), str(root)
    sd = {n: p.detach() for n, p in path_or_model.named_parameters()}  # tied: once
    return path_or_model.config.to_dict(), checkpoint_names(path_or_model, sd), \
        type(path_or_model).__name__


def read_config_json(path: Path) -> dict:
    """A config.json as a dict; one CheckpointError line naming the file when it is not
    JSON or not an object."""
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: a JSON {type(hf).__name__}, not an object")
    return hf


def checkpoint_names(model: nn.Module, tensors: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """A live `transformers` model's tensors under the names its checkpoints use
    (transformers >= 5 fuses some in memory, e.g. Mixtral's experts, and unfuses on save)."""
    try:
        # lazy: optional (tpkit[hf])
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: memory and checkpoint names agree
        return tensors
    return dict(revert_weight_conversion(model, dict(tensors)))


def hf_source(path_or_model: Any) -> HFSource:
    """The open Source of a Hugging Face directory or live model: its tensors in tpkit's
    names, its ModelConfig (`.config`), the tpkit tensors present (`.names`)."""
    hf, tensors, where = open_hf(path_or_model)
    try:
        fam, config = config_from_hf(hf, set(tensors.keys()))
    except (KeyError, TypeError, ValueError) as e:  # a field missing, of a wrong type, refused
        said = f"no field {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
        named = f"{where}/{CONFIG_FILE}" if isinstance(path_or_model, str | Path) else where
        raise CheckpointError(f"{named}: {said}") from None
    return HFSource(tensors, fam, fam.table(config), where, config)


def hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory, as every reader of it sees it: its
    config.json read with its tensor names (safetensors headers only, no weights)."""
    return hf_source(path).config


def memory_source(source: Any, config: ModelConfig | None = None) -> DictSource:
    """A Source over a tp=1 model or a dict of full tensors (padding cut)."""
    if isinstance(source, dict):
        if config is None:
            raise ValueError("a dict of tensors needs its ModelConfig")
        return DictSource(source, config)
    if source.mesh.tp_size * source.mesh.pp_size != 1:
        raise ValueError("to_hf(model) needs a tp=1, pp=1 model; save a checkpoint and "
                         "export that with `tpkit convert --to hf` instead")
    full = {n: p.detach()[:meta_of(p).logical_size or p.shape[0]]
            for n, p in source.named_parameters() if not meta_of(p).tied_to}
    return DictSource(full, source.config, type(source).__name__)


def write_hf(src: Any, out_dir: str | Path) -> Path:
    """Write a Hugging Face directory from any open `Source` of full logical tensors:
    every row goes back where the family's recipe took it from."""
    config, names = with_family(src.config), src.names
    fam, out = of_config(config), Path(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    for name, recipe in fam.table(config).items():
        if name in names:
            shape = src.logical_shape(name)
            full = src.read(name, 0, 0, shape[0]) if shape else src.read(name, 0, 0, 1)
            _put_back(full, recipe, fam.prefixes[0], tensors)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / HF_WEIGHTS),
              metadata={"format": "pt", MARK[0]: MARK[1]})
    (out / CONFIG_FILE).write_text(json.dumps(fam.to_hf(config), indent=1))
    return out


def written_by_tpkit(weights: Path) -> bool:
    """Whether `weights` is the safetensors file of an export tpkit wrote (`write_hf`'s
    model.safetensors, `weights.peft`'s adapters)."""
    try:
        return (open_safetensors(weights).metadata() or {}).get(MARK[0]) == MARK[1]
    except CheckpointError:
        return False


def _put_back(full: torch.Tensor, recipe: Recipe, prefix: str,
              tensors: dict[str, torch.Tensor]) -> None:
    """Cut `full` (tpkit layout) into its recipe's pieces, into `tensors` (HF layout)."""
    offset = 0
    for cut in recipe.cuts:
        n = full.shape[0] - offset if cut.rows is None else cut.rows
        part = full.narrow(0, offset, n).clone()
        part = part.T if recipe.transposed else part
        key = cut.key[1:] if cut.key.startswith("@") else prefix + cut.key
        if cut.rows is None:
            tensors[key] = part
        else:  # rows [start, start + n) of a tensor the other cuts fill too
            rows = max(c.start + c.rows for c in recipe.cuts if c.key == cut.key)
            buf = tensors.setdefault(key, part.new_empty((rows, *part.shape[1:])))
            buf[cut.start:cut.start + n] = part
        offset += n
