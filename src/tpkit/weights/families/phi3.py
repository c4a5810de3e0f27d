"""Phi-3: Llama-style with fused qkv_proj = [q; k; v] and gate_up_proj = [gate; up] in
the checkpoint. Both already have tpkit's fused layout, so each rank reads only its
rows of each part straight out of the fused tensor."""

from __future__ import annotations

from functools import partial

from tpkit.spec.config import ModelConfig
from tpkit.weights.families import decoder
from tpkit.weights.families.base import Family, refuse


def from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    """Phi-3 config.json -> ModelConfig."""
    refuse("phi3", decoder.problems(hf))
    return decoder.config(hf, sliding_window=hf.get("sliding_window"))


def to_hf(c: ModelConfig) -> dict:
    """ModelConfig -> config.json."""
    return decoder.to_hf(c, "phi3", "Phi3ForCausalLM", sliding_window=c.sliding_window,
                      original_max_position_embeddings=c.max_seq_len,
                      pad_token_id=None)  # Phi3Config's default 32000 may lie past the vocab


FAMILY = Family("phi3", ("phi3",), "Llama-style with fused qkv_proj and gate_up_proj, read slice by slice",
                from_hf, to_hf,
                partial(decoder.table, fused_qkv=True, mlp=decoder.dense_mlp(fused=True)))
