"""GPT-NeoX / Pythia: parallel residual, rotary on the first quarter of each head,
LayerNorm and biases, exact GELU, an untied head (`embed_out`), and a fused
query_key_value interleaved per head:

    query_key_value rows = [head 0: q k v | head 1: q k v | ...]   (3 hd rows per head)
    tpkit qkv rows       = [q of heads 0..nh-1 | k of heads ... | v of heads ...]

so tpkit's q part is nh cuts of hd rows each, every 3 hd rows, and a rank reading
its heads' q (or k, v) reads only those rows of the fused tensor.
"""

from __future__ import annotations

from tpkit.model.names import EMBED_WEIGHT, FINAL_NORM, layer
from tpkit.spec.config import ModelConfig
from tpkit.weights.families.base import (
    Cut,
    Family,
    Recipe,
    head,
    norm_pair,
    refuse,
    rope_of,
    rope_to_hf,
    whole,
)


def from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    """GPT-NeoX config.json -> ModelConfig."""
    rope_type, theta, factor = rope_of(hf)
    hd = hf["hidden_size"] // hf["num_attention_heads"]
    refuse("gpt_neox", {"rope type": rope_type if rope_type != "default" else None,
                        "activation": hf.get("hidden_act") if hf.get("hidden_act") != "gelu"
                        else None,
                        "no attention bias": not hf.get("attention_bias", True)})
    return ModelConfig(
        name="hf-gpt_neox", family="gpt_neox", vocab_size=hf["vocab_size"],
        hidden=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], ffn=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"], activation="gelu_exact", position="rope",
        rope_theta=theta, rope_dim=int(hd * factor), norm_eps=hf.get("layer_norm_eps", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        parallel_residual=hf.get("use_parallel_residual", True))


def to_hf(c: ModelConfig) -> dict:
    """ModelConfig -> config.json."""
    return dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"],
                hidden_size=c.hidden, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads, intermediate_size=c.ffn,
                max_position_embeddings=c.max_seq_len, vocab_size=c.vocab_size,
                hidden_act="gelu", layer_norm_eps=c.norm_eps, attention_bias=True,
                use_parallel_residual=c.parallel_residual, tie_word_embeddings=c.tie_embeddings,
                rotary_pct=c.rope_dim / c.head_dim, hidden_dropout=0.0, attention_dropout=0.0,
                **rope_to_hf(c, always_partial=True))  # NeoX's default factor is 0.25


def per_head_qkv(c: ModelConfig, key: str) -> Recipe:
    """tpkit's [q; k; v] as cuts of a query_key_value interleaved per head."""
    hd = c.head_dim
    return Recipe(tuple(Cut(key, (3 * i + j) * hd, hd)
                        for j in range(3) for i in range(c.num_heads)))


def table(c: ModelConfig) -> dict[str, Recipe]:
    """tpkit name -> Recipe (keys below 'gpt_neox.')."""
    out = {EMBED_WEIGHT: whole("embed_in.weight"),
           **norm_pair(FINAL_NORM, "final_layer_norm", True)}
    for i in range(c.num_layers):
        L, h = layer(i), f"layers.{i}"  # ours, the Hugging Face one
        out |= norm_pair(f"{L}.attn_norm", f"{h}.input_layernorm", True)
        out |= norm_pair(f"{L}.mlp_norm", f"{h}.post_attention_layernorm", True)
        for w in ("weight", "bias"):
            out[f"{L}.attn.qkv.{w}"] = per_head_qkv(c, f"{h}.attention.query_key_value.{w}")
            for ours, theirs in (("attn.out", "attention.dense"), ("mlp.fc1", "mlp.dense_h_to_4h"),
                                 ("mlp.fc2", "mlp.dense_4h_to_h")):
                out[f"{L}.{ours}.{w}"] = whole(f"{h}.{theirs}.{w}")
    return out | head(c, "@embed_out.weight")


FAMILY = Family("gpt_neox", ("gpt_neox",), "parallel residual, partial rotary, per-head interleaved fused qkv",
                from_hf, to_hf, table, prefixes=("gpt_neox.", ""))
