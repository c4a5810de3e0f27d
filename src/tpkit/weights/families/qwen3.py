"""Qwen3: Llama with RMSNorm over each head's q and k (before rotary) and a head width
decoupled from hidden / heads."""

from __future__ import annotations

from tpkit.spec.config import ModelConfig
from tpkit.weights.families import decoder
from tpkit.weights.families.base import Family, refuse


def from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    """Qwen3 config.json -> ModelConfig."""
    refuse("qwen3", decoder.problems(hf) | {"attention bias": hf.get("attention_bias")})
    return decoder.config(hf, qk_norm=True)


def to_hf(c: ModelConfig) -> dict:
    """ModelConfig -> config.json."""
    return decoder.to_hf(c, "qwen3", "Qwen3ForCausalLM", use_sliding_window=False)


FAMILY = Family("qwen3", ("qwen3",), "Llama + RMSNorm on each head's q and k; head_dim decoupled from hidden",
                from_hf, to_hf, decoder.table)
