"""Hugging Face families as adapters: one module per family, found by model_type.

Each module of this package (but `base` and `decoder`, the shared parts) defines
`FAMILY`, a `base.Family`: config.json -> ModelConfig and back, the name table with
its fused-tensor cuts; the block features it needs are flags of the ModelConfig it
returns. tpkit's presets name their family (`ModelConfig.family`). Adding a family = one new file here (+ its tests). Pure Python.

    family = for_model_type(config_json["model_type"])   # ValueError naming the supported
    config = family.from_hf(config_json, tensor_keys)
    family = of_config(config)                            # export: by config.family
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace

from tpkit.spec.config import PRESETS, ModelConfig
from tpkit.spec.errors import UserError
from tpkit.weights.families.base import Cut, Family, Recipe

_SHARED = ("base", "decoder")


def _discover() -> dict[str, Family]:
    out: dict[str, Family] = {}
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if m.name not in _SHARED:
            fam = importlib.import_module(f"{__name__}.{m.name}").FAMILY
            out |= {kind: fam for kind in fam.model_types}
    return out


BY_MODEL_TYPE: dict[str, Family] = _discover()


def supported() -> list[str]:
    """Every Hugging Face model_type tpkit reads and writes."""
    return sorted(BY_MODEL_TYPE)


def for_model_type(kind: str | None) -> Family:
    """The adapter of a model_type; an unsupported one is an error naming the supported."""
    if kind not in BY_MODEL_TYPE:
        raise UserError(f"model_type {kind!r} is not supported; supported: "
                         f"{', '.join(supported())}")
    return BY_MODEL_TYPE[kind]


def of_config(c: ModelConfig) -> Family:
    """The adapter that exports `c` (by `with_family(c).family`)."""
    return for_model_type(with_family(c).family)


def with_family(c: ModelConfig) -> ModelConfig:
    """`c` with its `family` (a Hugging Face model_type) filled: for a config without one
    (built by hand, or saved before configs named their family) the family whose plain
    shape it has: GPT-2, Llama or BERT."""
    kind = c.family or _plain_family(c)
    if not kind:
        raise UserError(f"{c.name}: no Hugging Face family (config.family is empty and "
                         f"position={c.position}, norm={c.norm}, activation={c.activation}, "
                         f"bias={c.bias} is none of the plain gpt2/llama/bert shapes); "
                         f"supported: {', '.join(supported())}")
    for_model_type(kind)  # a family this build supports
    return replace(c, family=kind)


_FAMILY_FEATURES = ("qk_norm", "norm_offset", "embed_scale", "parallel_residual",
                    "rope_llama3", "sliding_window", "num_experts")  # set by one family's
# adapter only: never guessed (nor a head width, q/k/v bias or rotary width of its own)


def _plain_family(c: ModelConfig) -> str:
    defaults = ModelConfig()
    if any(getattr(c, f) != getattr(defaults, f) for f in _FAMILY_FEATURES) or (
            c.head_dim * c.num_heads != c.hidden or c.attn_bias != c.bias
            or c.rope_dim != c.head_dim):
        return ""
    if not c.causal and c.embed_norm and not c.pre_norm:
        return "bert"
    if c.position == "rope" and c.norm == "rmsnorm" and c.activation == "swiglu" and not c.bias:
        return "llama"
    if c.position == "learned" and c.norm == "layernorm" and c.causal and c.bias:
        return "gpt2"
    return ""

def presets_of(kind: str) -> list[str]:
    """tpkit's presets that export to this model_type."""
    return [name for name, c in PRESETS.items() if c.family == kind]


def config_from_hf(hf: dict, keys: set[str] | None = None) -> tuple[Family, ModelConfig]:
    """(adapter, ModelConfig) of a config.json dict (and its tensor names, if known)."""
    fam = for_model_type(hf.get("model_type"))
    return fam, fam.from_hf(hf, set(keys or ()))


__all__ = ["BY_MODEL_TYPE", "Cut", "Family", "Recipe", "config_from_hf", "for_model_type",
           "of_config", "presets_of", "supported"]
