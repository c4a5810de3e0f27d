"""Hugging Face <-> tpkit: configs and the name table. Pure Python.

Every tpkit parameter is made of Hugging Face tensors concatenated on dim 0, in
tpkit's [out, in] layout (GPT-2's Conv1D stores [in, out]: transposed):

    layers.{i}.attn.qkv.weight  = [q_proj; k_proj; v_proj]      (Llama, BERT)
                                = c_attn.weight^T               (GPT-2, already fused)
    layers.{i}.mlp.fc1.weight   = [gate_proj; up_proj]          (SwiGLU)
"""

from __future__ import annotations

from tpkit.model.names import EMBED_WEIGHT, HEAD_WEIGHT, POOLER_WEIGHT
from tpkit.spec.config import ModelConfig

Recipe = tuple[tuple[str, ...], bool]  # Hugging Face keys concatenated on dim 0, transposed?


# -- configs ----------------------------------------------------------------------------
def config_from_hf(hf: dict) -> tuple[str, ModelConfig]:
    """(family, ModelConfig) for a Hugging Face config.json dict; ValueError if unsupported."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        act = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}.get(
            hf.get("activation_function", "gelu_new"))
        if act is None or hf.get("scale_attn_by_inverse_layer_idx") or \
                not hf.get("scale_attn_weights", True):
            raise ValueError(f"gpt2 variant not supported: activation "
                             f"{hf.get('activation_function')!r}, attention scaling options")
        return "gpt2", ModelConfig(
            name="hf-gpt2", vocab_size=hf["vocab_size"], hidden=hf["n_embd"],
            num_layers=hf["n_layer"], num_heads=hf["n_head"], ffn_hidden=hf.get("n_inner"),
            max_seq_len=hf["n_positions"], activation=act,
            tie_embeddings=hf.get("tie_word_embeddings", True),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5))
    if kind in ("llama", "mistral"):
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        heads = hf["num_attention_heads"]
        bad = [k for k in ("attention_bias", "mlp_bias") if hf.get(k)]
        if rope.get("rope_type", "default") != "default" or hf.get("hidden_act") != "silu" \
                or hf.get("head_dim", hf["hidden_size"] // heads) != hf["hidden_size"] // heads \
                or bad:
            raise ValueError(f"{kind} variant not supported (rope {rope.get('rope_type')}, "
                             f"act {hf.get('hidden_act')}, head_dim, biases {bad})")
        return "llama", ModelConfig(
            name=f"hf-{kind}", vocab_size=hf["vocab_size"], hidden=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            ffn_hidden=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
            norm="rmsnorm", activation="swiglu", position="rope",
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            tie_embeddings=hf.get("tie_word_embeddings", False), bias=False,
            norm_eps=hf.get("rms_norm_eps", 1e-6))
    if kind == "bert":
        if hf.get("hidden_act", "gelu") != "gelu" or \
                hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("bert variant not supported (activation or position type)")
        return "bert", ModelConfig(
            name="hf-bert", vocab_size=hf["vocab_size"], hidden=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            ffn_hidden=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
            causal=False, type_vocab_size=hf["type_vocab_size"], pre_norm=False,
            embed_norm=True, activation="gelu_exact", norm_eps=hf.get("layer_norm_eps", 1e-12))
    raise ValueError(f"model_type {kind!r} is not supported (gpt2, llama, mistral, bert)")


def family_of(c: ModelConfig) -> str:
    """Which Hugging Face family a tpkit config exports to."""
    if bert_style(c):
        return "bert"
    if c.position == "rope" and c.norm == "rmsnorm" and c.activation == "swiglu" and not c.bias:
        return "llama"
    if c.position == "learned" and c.norm == "layernorm" and c.causal and c.bias:
        return "gpt2"
    raise ValueError(f"{c.name}: no Hugging Face family has position={c.position}, "
                     f"norm={c.norm}, activation={c.activation}, bias={c.bias}")


def config_to_hf(c: ModelConfig) -> dict:
    """The config.json of the exported model."""
    fam = family_of(c)
    if fam == "gpt2":
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=c.hidden,
                    n_layer=c.num_layers, n_head=c.num_heads, n_inner=c.ffn,
                    n_positions=c.max_seq_len, vocab_size=c.vocab_size,
                    activation_function="gelu_new" if c.activation == "gelu" else c.activation,
                    layer_norm_epsilon=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if fam == "llama":
        return dict(model_type="llama", architectures=["LlamaForCausalLM"],
                    hidden_size=c.hidden, intermediate_size=c.ffn, num_hidden_layers=c.num_layers,
                    num_attention_heads=c.num_heads, num_key_value_heads=c.kv_heads,
                    head_dim=c.head_dim, max_position_embeddings=c.max_seq_len,
                    vocab_size=c.vocab_size, rms_norm_eps=c.norm_eps, hidden_act="silu",
                    rope_theta=c.rope_theta,
                    rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta),
                    tie_word_embeddings=c.tie_embeddings, attention_bias=False, mlp_bias=False)
    return dict(model_type="bert", architectures=["BertModel"], hidden_size=c.hidden,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                intermediate_size=c.ffn, max_position_embeddings=c.max_seq_len,
                vocab_size=c.vocab_size, type_vocab_size=c.type_vocab_size,
                layer_norm_eps=c.norm_eps, hidden_act="gelu", hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)


# -- name tables ------------------------------------------------------------------------
def table(fam: str, c: ModelConfig) -> dict[str, Recipe]:
    """tpkit name -> (Hugging Face keys, transposed) for the whole model (no prefixes)."""
    out: dict[str, Recipe] = {}
    wb = ("weight", "bias")
    for i in range(c.num_layers):
        L = f"layers.{i}"
        if fam == "gpt2":
            h = f"h.{i}"
            for ours, theirs, tr in (("attn_norm", "ln_1", False), ("mlp_norm", "ln_2", False),
                                     ("attn.qkv", "attn.c_attn", True),
                                     ("attn.out", "attn.c_proj", True),
                                     ("mlp.fc1", "mlp.c_fc", True), ("mlp.fc2", "mlp.c_proj", True)):
                for w in wb:
                    out[f"{L}.{ours}.{w}"] = ((f"{h}.{theirs}.{w}",), tr and w == "weight")
        elif fam == "llama":
            h = f"layers.{i}"
            a = f"{h}.self_attn"
            out[f"{L}.attn_norm.weight"] = ((f"{h}.input_layernorm.weight",), False)
            out[f"{L}.mlp_norm.weight"] = ((f"{h}.post_attention_layernorm.weight",), False)
            out[f"{L}.attn.qkv.weight"] = (tuple(f"{a}.{x}_proj.weight" for x in "qkv"), False)
            out[f"{L}.attn.out.weight"] = ((f"{a}.o_proj.weight",), False)
            out[f"{L}.mlp.fc1.weight"] = ((f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight"),
                                          False)
            out[f"{L}.mlp.fc2.weight"] = ((f"{h}.mlp.down_proj.weight",), False)
        else:
            h = f"encoder.layer.{i}"
            for w in wb:
                out[f"{L}.attn.qkv.{w}"] = (tuple(f"{h}.attention.self.{x}.{w}"
                                                  for x in ("query", "key", "value")), False)
                for ours, theirs in (("attn.out", "attention.output.dense"),
                                     ("attn_norm", "attention.output.LayerNorm"),
                                     ("mlp.fc1", "intermediate.dense"),
                                     ("mlp.fc2", "output.dense"), ("mlp_norm", "output.LayerNorm")):
                    out[f"{L}.{ours}.{w}"] = ((f"{h}.{theirs}.{w}",), False)
    out.update(_outer(fam, c))
    return out


def _outer(fam: str, c: ModelConfig) -> dict[str, Recipe]:
    if fam == "gpt2":
        out = {EMBED_WEIGHT: (("wte.weight",), False),
               "embed.position.weight": (("wpe.weight",), False),
               "final_norm.weight": (("ln_f.weight",), False),
               "final_norm.bias": (("ln_f.bias",), False)}
    elif fam == "llama":
        out = {EMBED_WEIGHT: (("embed_tokens.weight",), False),
               "final_norm.weight": (("norm.weight",), False)}
    else:
        e = "embeddings"
        out = {EMBED_WEIGHT: ((f"{e}.word_embeddings.weight",), False),
               "embed.position.weight": ((f"{e}.position_embeddings.weight",), False),
               "embed.token_type.weight": ((f"{e}.token_type_embeddings.weight",), False),
               "embed.norm.weight": ((f"{e}.LayerNorm.weight",), False),
               "embed.norm.bias": ((f"{e}.LayerNorm.bias",), False),
               POOLER_WEIGHT: (("pooler.dense.weight",), False),
               "pooler.bias": (("pooler.dense.bias",), False)}
    if not c.tie_embeddings and fam != "bert":
        out[HEAD_WEIGHT] = (("@lm_head.weight",), False)  # '@': outside the base prefix
    return out


def bert_style(c: ModelConfig) -> bool:
    """A bidirectional post-norm encoder with token types: BERT."""
    return not c.causal and not c.pre_norm and c.embed_norm and c.type_vocab_size > 0
