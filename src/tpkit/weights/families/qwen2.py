"""Qwen2 / Qwen2.5: Llama with a bias on q, k, v (not on o) and, in the small ones,
tied embeddings."""

from __future__ import annotations

from tpkit.spec.config import ModelConfig
from tpkit.weights.families import decoder
from tpkit.weights.families.base import Family, refuse


def from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    """Qwen2 config.json -> ModelConfig."""
    refuse("qwen2", decoder.problems(hf))
    return decoder.config(hf, attn_bias=True)


def to_hf(c: ModelConfig) -> dict:
    """ModelConfig -> config.json."""
    return decoder.to_hf(c, "qwen2", "Qwen2ForCausalLM", use_sliding_window=False)


FAMILY = Family("qwen2", ("qwen2",), "Llama + bias on q, k, v; tied embeddings in the small sizes",
                from_hf, to_hf, decoder.table)
