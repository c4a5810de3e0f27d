"""Mixtral: Mistral attention, and a mixture-of-experts MLP with top-2 routing.

    block_sparse_moe.gate.weight          -> mlp.router.weight            (replicated)
    block_sparse_moe.experts.{e}.w1 / w3  -> mlp.experts.{e}.fc1 = [w1; w3] (gate; up)
    block_sparse_moe.experts.{e}.w2       -> mlp.experts.{e}.fc2
"""

from __future__ import annotations

from functools import partial

from tpkit.model.families.base import Family, Recipe, refuse, stacked, whole
from tpkit.model.families.decoder import decoder_config, decoder_hf, decoder_problems, decoder_table
from tpkit.spec.config import ModelConfig


def from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    """Mixtral config.json -> ModelConfig."""
    refuse("mixtral", decoder_problems(hf) | {"router jitter": hf.get("router_jitter_noise")})
    return decoder_config(hf, sliding_window=hf.get("sliding_window"),
                          num_experts=hf["num_local_experts"],
                          experts_per_token=hf.get("num_experts_per_tok", 2))


def to_hf(c: ModelConfig) -> dict:
    """ModelConfig -> config.json."""
    return decoder_hf(c, "mixtral", "MixtralForCausalLM", sliding_window=c.sliding_window,
                      num_local_experts=c.num_experts, num_experts_per_tok=c.experts_per_token,
                      router_jitter_noise=0.0)


def experts(c: ModelConfig, h: str) -> dict[str, Recipe]:
    """The router and every expert's fc1 = [w1; w3], fc2 = w2."""
    m = f"{h}.block_sparse_moe"
    out = {"mlp.router.weight": whole(f"{m}.gate.weight")}
    for e in range(c.num_experts):
        x = f"{m}.experts.{e}"
        out[f"mlp.experts.{e}.fc1.weight"] = stacked((f"{x}.w1.weight", c.ffn),
                                                     (f"{x}.w3.weight", c.ffn))
        out[f"mlp.experts.{e}.fc2.weight"] = whole(f"{x}.w2.weight")
    return out


FAMILY = Family("mixtral", ("mixtral",), "Mistral attention + top-2 mixture of experts, each expert tp-split",
                from_hf, to_hf, partial(decoder_table, mlp=experts))
