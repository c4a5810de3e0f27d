"""BERT: a bidirectional post-norm encoder (no final norm) with an embedding LayerNorm,
token types, exact (erf) GELU, and a pooler when the checkpoint has one."""

from __future__ import annotations

from tpkit.model.names import (
    EMBED_NORM,
    EMBED_WEIGHT,
    POOLER,
    POSITION_WEIGHT,
    TOKEN_TYPE_WEIGHT,
    layer,
)
from tpkit.spec.config import ModelConfig
from tpkit.weights.families.base import Family, Recipe, norm_pair, refuse, stacked, whole


def from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    """BERT config.json (+ whether its tensors include a pooler) -> ModelConfig."""
    refuse("bert", {"activation": hf.get("hidden_act") if hf.get("hidden_act", "gelu") != "gelu"
                    else None,
                    "position type": hf.get("position_embedding_type")
                    if hf.get("position_embedding_type", "absolute") != "absolute" else None})
    return ModelConfig(
        name="hf-bert", family="bert", vocab_size=hf["vocab_size"], hidden=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        ffn=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
        causal=False, type_vocab_size=hf["type_vocab_size"], pre_norm=False,
        embed_norm=True, activation="gelu_exact", norm_eps=hf.get("layer_norm_eps", 1e-12),
        pooler=any(k.endswith("pooler.dense.weight") for k in keys))


def to_hf(c: ModelConfig) -> dict:
    """ModelConfig -> config.json."""
    return dict(model_type="bert", architectures=["BertModel"], hidden_size=c.hidden,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                intermediate_size=c.ffn, max_position_embeddings=c.max_seq_len,
                vocab_size=c.vocab_size, type_vocab_size=c.type_vocab_size,
                layer_norm_eps=c.norm_eps, hidden_act="gelu", hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)


def table(c: ModelConfig) -> dict[str, Recipe]:
    """tpkit name -> Recipe (keys below '' or 'bert.')."""
    e = "embeddings"
    out = {EMBED_WEIGHT: whole(f"{e}.word_embeddings.weight"),
           POSITION_WEIGHT: whole(f"{e}.position_embeddings.weight"),
           TOKEN_TYPE_WEIGHT: whole(f"{e}.token_type_embeddings.weight"),
           **norm_pair(EMBED_NORM, f"{e}.LayerNorm", True)}
    if c.pooler:
        out |= {f"{POOLER}.{w}": whole(f"pooler.dense.{w}") for w in ("weight", "bias")}
    for i in range(c.num_layers):
        L, h = layer(i), f"encoder.layer.{i}"
        for w in ("weight", "bias"):
            out[f"{L}.attn.qkv.{w}"] = stacked(*((f"{h}.attention.self.{x}.{w}", c.hidden)
                                                 for x in ("query", "key", "value")))
            for ours, theirs in (("attn.out", "attention.output.dense"),
                                 ("mlp.fc1", "intermediate.dense"), ("mlp.fc2", "output.dense")):
                out[f"{L}.{ours}.{w}"] = whole(f"{h}.{theirs}.{w}")
        out |= norm_pair(f"{L}.attn_norm", f"{h}.attention.output.LayerNorm", True)
        out |= norm_pair(f"{L}.mlp_norm", f"{h}.output.LayerNorm", True)
    return out


FAMILY = Family("bert", ("bert",), "post-norm bidirectional encoder, token types, erf GELU, optional pooler",
                from_hf, to_hf, table, prefixes=("", "bert."))
