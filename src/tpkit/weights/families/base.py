"""What a Hugging Face family adapter declares, and the pieces every family shares.
Pure Python (no torch): the planner may read it.

Every tpkit parameter is made of rows of Hugging Face tensors concatenated on dim 0,
in tpkit's [out, in] layout (a `Recipe` of `Cut`s):

    layers.{i}.attn.qkv.weight = [q_proj; k_proj; v_proj]          (three whole tensors)
                               = qkv_proj                           (Phi-3: already fused)
                               = c_attn.weight^T                    (GPT-2: transposed)
                               = [qkv rows of head 0's q, head 1's q, ..., head 0's k, ...]
                                                                    (GPT-NeoX: per head)
    layers.{i}.mlp.fc1.weight  = [gate_proj; up_proj] or gate_up_proj

A rank asks for rows [a, b) of the tpkit tensor (its slice of each q/k/v or gate/up
part); the recipe maps them onto rows of the Hugging Face tensors, so a fused
checkpoint tensor is read only where this rank's slices lie.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tpkit.model.names import HEAD_WEIGHT
from tpkit.spec.config import ModelConfig


@dataclass(frozen=True)
class Cut:
    """`rows` rows of Hugging Face tensor `key` from row `start` (rows None: all of it).
    A key starting with '@' lies outside the model's base prefix (e.g. '@lm_head.weight')."""

    key: str
    start: int = 0
    rows: int | None = None


@dataclass(frozen=True)
class Recipe:
    """A tpkit tensor = its cuts concatenated on dim 0 (each transposed first if asked)."""

    cuts: tuple[Cut, ...]
    transposed: bool = False

    def __post_init__(self) -> None:
        if self.transposed and len(self.cuts) > 1:
            raise ValueError("a transposed recipe is one whole tensor (GPT-2's Conv1D)")


def whole(key: str, transposed: bool = False) -> Recipe:
    """One whole Hugging Face tensor."""
    return Recipe((Cut(key),), transposed)


def stacked(*parts: tuple[str, int]) -> Recipe:
    """Whole tensors (key, rows) one under the other, e.g. [q_proj; k_proj; v_proj]."""
    return Recipe(tuple(Cut(k, 0, n) for k, n in parts))


@dataclass(frozen=True)
class Family:
    """One Hugging Face family: configs both ways, the name table, where the keys live.

    `summary`: one line, what its blocks need; `from_hf(config_json, tensor_keys)` -> ModelConfig (ValueError naming what is not
    supported); `to_hf(config)` -> config.json; `table(config)` -> tpkit name -> Recipe
    (keys relative to the base prefix); `prefixes`: the base prefixes a checkpoint may
    use, the first one written on export.
    """

    name: str
    model_types: tuple[str, ...]
    summary: str
    from_hf: Callable[[dict, set[str]], ModelConfig]
    to_hf: Callable[[ModelConfig], dict]
    table: Callable[[ModelConfig], dict[str, Recipe]]
    prefixes: tuple[str, ...] = ("model.", "")


def refuse(kind: str, problems: dict[str, object]) -> None:
    """ValueError listing every unsupported option of a `kind` config (none: return)."""
    bad = {k: v for k, v in problems.items() if v}
    if bad:
        raise ValueError(f"{kind} variant not supported: " +
                         ", ".join(f"{k} ({v})" for k, v in bad.items()))


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")  # Llama 3.1's rope scaling, in order


def llama3_of(hf: dict) -> tuple | None:
    """Llama 3.1's rope scaling parameters (None: no such scaling)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    return tuple(rope[k] for k in LLAMA3_KEYS)


def rope_of(hf: dict) -> tuple[str, float, float]:
    """(rope type, theta, partial rotary factor) from either config.json generation."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    factor = rope.get("partial_rotary_factor",
                      hf.get("partial_rotary_factor", hf.get("rotary_pct", 1.0)))
    return rope.get("rope_type", rope.get("type", "default")), float(theta), float(factor)


def rope_to_hf(c: ModelConfig, always_partial: bool = False) -> dict:
    """rope_theta (older readers) and rope_parameters (transformers >= 5)."""
    rope = dict(rope_type="default", rope_theta=c.rope_theta)
    if c.rope_llama3:
        rope |= dict(zip(LLAMA3_KEYS, c.rope_llama3), rope_type="llama3")
    if c.rope_dim != c.head_dim or always_partial:
        rope["partial_rotary_factor"] = c.rope_dim / c.head_dim
    return dict(rope_theta=c.rope_theta, rope_parameters=rope)


def norm_pair(ours: str, theirs: str, bias: bool) -> dict[str, Recipe]:
    """A norm's weight (and bias)."""
    out = {f"{ours}.weight": whole(f"{theirs}.weight")}
    if bias:
        out[f"{ours}.bias"] = whole(f"{theirs}.bias")
    return out


def head(c: ModelConfig, key: str = "@lm_head.weight") -> dict[str, Recipe]:
    """The output projection, unless tied to the embedding."""
    return {} if c.tie_embeddings else {HEAD_WEIGHT: whole(key)}
