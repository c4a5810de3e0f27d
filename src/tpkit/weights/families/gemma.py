"""Gemma (1): GeGLU (tanh GELU), RMSNorm scaling by (1 + w), embeddings times
sqrt(hidden), a head width decoupled from hidden (256 in the released sizes), tied head."""

from __future__ import annotations

from tpkit.spec.config import ModelConfig
from tpkit.weights.families import decoder
from tpkit.weights.families.base import Family, refuse

ACT = "gelu_pytorch_tanh"  # transformers maps Gemma's legacy "gelu" to it too


def from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    """Gemma config.json -> ModelConfig."""
    hf = dict(hf, hidden_act=ACT if hf.get("hidden_act") in ("gelu", None) else hf["hidden_act"])
    refuse("gemma", decoder.problems(hf, act=ACT) | {
        "attention bias": hf.get("attention_bias"),
        "bidirectional attention": hf.get("use_bidirectional_attention")})
    return decoder.config(hf, activation="geglu", norm_offset=1.0,
                          embed_scale=hf["hidden_size"] ** 0.5,
                          tie_embeddings=hf.get("tie_word_embeddings", True))


def to_hf(c: ModelConfig) -> dict:
    """ModelConfig -> config.json."""
    return decoder.to_hf(c, "gemma", "GemmaForCausalLM", hidden_act=ACT)


FAMILY = Family("gemma", ("gemma",), "GeGLU (tanh), RMSNorm (1 + w), embeddings * sqrt(hidden), head_dim 256-style",
                from_hf, to_hf, decoder.table)
