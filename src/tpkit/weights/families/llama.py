"""Llama (1, 2, 3, and 3.1+ with its rope frequency scaling) and Mistral (grouped-query
attention; Mistral's sliding window)."""

from __future__ import annotations

from tpkit.spec.config import ModelConfig
from tpkit.weights.families import decoder
from tpkit.weights.families.base import Family, llama3_of, refuse

ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


def from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    """Llama / Mistral config.json -> ModelConfig."""
    refuse(hf["model_type"], decoder.problems(hf, ropes=("default", "llama3")) |
           {"attention bias": hf.get("attention_bias")})
    return decoder.config(hf, sliding_window=hf.get("sliding_window"), rope_llama3=llama3_of(hf))


def to_hf(c: ModelConfig) -> dict:
    """ModelConfig -> config.json."""
    extra = dict(sliding_window=c.sliding_window) if c.family == "mistral" else {}
    return decoder.to_hf(c, c.family, ARCH[c.family], **extra)


FAMILY = Family("llama", tuple(ARCH),
                "RMSNorm, SwiGLU, rotary (+ Llama 3.1 scaling), GQA; Mistral: sliding window",
                from_hf, to_hf, decoder.table)
