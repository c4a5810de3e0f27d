"""The Llama-style decoder that most Hugging Face families share (Llama, Mistral, Qwen2,
Qwen3, Gemma, Phi-3, Mixtral): its config fields and its name table, written once;
each family module states only how it differs. Pure Python.

    model.embed_tokens -> layers.{i}: input_layernorm, self_attn.{q,k,v,o}_proj,
    post_attention_layernorm, mlp.{gate,up,down}_proj -> model.norm -> lm_head
"""

from __future__ import annotations

from collections.abc import Callable

from tpkit.model.names import EMBED_WEIGHT, FINAL_NORM_WEIGHT, layer
from tpkit.spec.config import ModelConfig
from tpkit.weights.families.base import Recipe, head, rope_of, rope_to_hf, stacked, whole


def config(hf: dict, **flags) -> ModelConfig:
    """The fields every Llama-style config.json has; `flags` set the family's features."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    _, theta, factor = rope_of(hf)
    fields = dict(
        name=f"hf-{hf['model_type']}", family=hf["model_type"], vocab_size=hf["vocab_size"],
        hidden=hidden, num_layers=hf["num_hidden_layers"], num_heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads, ffn=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"], norm="rmsnorm", activation="swiglu",
        position="rope", rope_theta=theta, tie_embeddings=hf.get("tie_word_embeddings", False),
        bias=False, norm_eps=hf.get("rms_norm_eps", 1e-6),
        head_dim=head_dim, rope_dim=int(head_dim * factor))
    return ModelConfig(**{**fields, **flags})


def problems(hf: dict, act: str = "silu", ropes: tuple[str, ...] = ("default",)
             ) -> dict[str, object]:
    """Options of a Llama-style config that tpkit does not implement (empty values: fine)."""
    rope_type = rope_of(hf)[0]
    layers = set(hf.get("layer_types") or ["full_attention"])
    return {"rope type": rope_type if rope_type not in ropes else None,
            "activation": hf.get("hidden_act") if hf.get("hidden_act", act) != act else None,
            "mlp bias": hf.get("mlp_bias"),
            "sliding-window layers": sorted(layers) if layers != {"full_attention"} or
            hf.get("use_sliding_window") else None}


def to_hf(c: ModelConfig, model_type: str, arch: str, **extra) -> dict:
    """The config.json fields every Llama-style family has, plus `extra`."""
    return dict(model_type=model_type, architectures=[arch], hidden_size=c.hidden,
                intermediate_size=c.ffn, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads, num_key_value_heads=c.kv_heads,
                head_dim=c.head_dim, max_position_embeddings=c.max_seq_len,
                vocab_size=c.vocab_size, rms_norm_eps=c.norm_eps, hidden_act="silu",
                tie_word_embeddings=c.tie_embeddings, attention_bias=False, mlp_bias=False,
                **rope_to_hf(c)) | extra


MlpTable = Callable[[ModelConfig, str], dict[str, Recipe]]


def dense_mlp(fused: bool = False) -> MlpTable:
    """gate/up/down (or Phi-3's fused gate_up_proj) as tpkit's [gate; up] fc1 and fc2."""
    def table(c: ModelConfig, h: str) -> dict[str, Recipe]:
        m = f"{h}.mlp"
        fc1 = whole(f"{m}.gate_up_proj.weight") if fused else \
            stacked((f"{m}.gate_proj.weight", c.ffn), (f"{m}.up_proj.weight", c.ffn))
        return {"mlp.fc1.weight": fc1, "mlp.fc2.weight": whole(f"{m}.down_proj.weight")}
    return table


SEPARATE_MLP = dense_mlp()


def table(c: ModelConfig, *, fused_qkv: bool = False,
                  mlp: MlpTable = SEPARATE_MLP) -> dict[str, Recipe]:
    """tpkit name -> Recipe for a Llama-style model (keys below the base prefix)."""
    out = {EMBED_WEIGHT: whole("embed_tokens.weight"),
           FINAL_NORM_WEIGHT: whole("norm.weight")}
    for i in range(c.num_layers):
        h = f"layers.{i}"  # the Hugging Face name (below the base prefix)
        ours = {"attn_norm.weight": whole(f"{h}.input_layernorm.weight"),
                "mlp_norm.weight": whole(f"{h}.post_attention_layernorm.weight"),
                "attn.out.weight": whole(f"{h}.self_attn.o_proj.weight"),
                **_qkv(c, f"{h}.self_attn", fused_qkv), **mlp(c, h)}
        out.update({f"{layer(i)}.{k}": v for k, v in ours.items()})
    return out | head(c)


def _qkv(c: ModelConfig, a: str, fused: bool) -> dict[str, Recipe]:
    rows = (c.num_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim)
    kinds = ("weight", "bias") if c.attn_bias else ("weight",)
    out = {f"attn.qkv.{w}": whole(f"{a}.qkv_proj.{w}") if fused else
           stacked(*((f"{a}.{x}_proj.{w}", n) for x, n in zip("qkv", rows))) for w in kinds}
    if c.qk_norm:
        out |= {f"attn.{x}_norm.weight": whole(f"{a}.{x}_norm.weight") for x in "qk"}
    return out
