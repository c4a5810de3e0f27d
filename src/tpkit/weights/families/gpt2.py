"""GPT-2: learned positions, LayerNorm, biases, tanh GELU; Conv1D weights stored
[in, out] (transposed), attention already fused as c_attn = [q | k | v]."""

from __future__ import annotations

from tpkit.model.names import EMBED_WEIGHT, FINAL_NORM, POSITION_WEIGHT, layer
from tpkit.spec.config import ModelConfig
from tpkit.weights.families.base import Family, Recipe, head, norm_pair, refuse, whole

ACTS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}


def from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    """GPT-2 config.json -> ModelConfig."""
    act = ACTS.get(hf.get("activation_function", "gelu_new"))
    refuse("gpt2", {"activation": None if act else hf.get("activation_function"),
                    "scale_attn_by_inverse_layer_idx": hf.get("scale_attn_by_inverse_layer_idx"),
                    "unscaled attention": not hf.get("scale_attn_weights", True)})
    return ModelConfig(
        name="hf-gpt2", family="gpt2", vocab_size=hf["vocab_size"], hidden=hf["n_embd"],
        num_layers=hf["n_layer"], num_heads=hf["n_head"], ffn=hf.get("n_inner"),
        max_seq_len=hf["n_positions"], activation=act,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5))


def to_hf(c: ModelConfig) -> dict:
    """ModelConfig -> config.json."""
    return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=c.hidden,
                n_layer=c.num_layers, n_head=c.num_heads, n_inner=c.ffn,
                n_positions=c.max_seq_len, vocab_size=c.vocab_size,
                activation_function="gelu_new" if c.activation == "gelu" else c.activation,
                layer_norm_epsilon=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def table(c: ModelConfig) -> dict[str, Recipe]:
    """tpkit name -> Recipe (keys below 'transformer.')."""
    out = {EMBED_WEIGHT: whole("wte.weight"), POSITION_WEIGHT: whole("wpe.weight"),
           **norm_pair(FINAL_NORM, "ln_f", True)}
    for i in range(c.num_layers):
        L, h = layer(i), f"h.{i}"
        out |= norm_pair(f"{L}.attn_norm", f"{h}.ln_1", True)
        out |= norm_pair(f"{L}.mlp_norm", f"{h}.ln_2", True)
        for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.out", "attn.c_proj"),
                             ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            out[f"{L}.{ours}.weight"] = whole(f"{h}.{theirs}.weight", transposed=True)
            out[f"{L}.{ours}.bias"] = whole(f"{h}.{theirs}.bias")
    return out | head(c)


FAMILY = Family("gpt2", ("gpt2",), "learned positions, LayerNorm, biases, tanh GELU, Conv1D [in, out] weights",
                from_hf, to_hf, table, prefixes=("transformer.", ""))
