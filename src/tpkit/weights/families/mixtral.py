"""Mixtral: Mistral attention, and a mixture-of-experts MLP with top-2 routing.

    block_sparse_moe.gate.weight     -> mlp.router.weight                    (replicated)
    block_sparse_moe.experts.{e}.w*  -> mlp.fc1.weight = [w1_0; w3_0; w1_1; w3_1; ...]
                                        mlp.fc2.weight = [w2_0; w2_1; ...]   (stacked)
"""

from __future__ import annotations

from functools import partial

from tpkit.spec.config import ModelConfig
from tpkit.weights.families import decoder
from tpkit.weights.families.base import Family, Recipe, refuse, stacked, whole


def from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    """Mixtral config.json -> ModelConfig."""
    refuse("mixtral", decoder.problems(hf) | {"router jitter": hf.get("router_jitter_noise")})
    return decoder.config(hf, sliding_window=hf.get("sliding_window"),
                          num_experts=hf["num_local_experts"],
                          experts_per_token=hf.get("num_experts_per_tok", 2))


def to_hf(c: ModelConfig) -> dict:
    """ModelConfig -> config.json."""
    return decoder.to_hf(c, "mixtral", "MixtralForCausalLM", sliding_window=c.sliding_window,
                      num_local_experts=c.num_experts, num_experts_per_tok=c.experts_per_token,
                      router_jitter_noise=0.0)


def experts(c: ModelConfig, h: str) -> dict[str, Recipe]:
    """The router, and every expert's [w1; w3] (gate; up) and w2 stacked."""
    x = f"{h}.block_sparse_moe"
    E = range(c.num_experts)
    return {"mlp.router.weight": whole(f"{x}.gate.weight"),
            "mlp.fc1.weight": stacked(*((f"{x}.experts.{e}.w{k}.weight", c.ffn)
                                        for e in E for k in (1, 3))),
            "mlp.fc2.weight": stacked(*((f"{x}.experts.{e}.w2.weight", c.hidden) for e in E))}


FAMILY = Family("mixtral", ("mixtral",), "Mistral attention + top-2 mixture of experts, each expert tp-split",
                from_hf, to_hf, partial(decoder.table, mlp=experts))
