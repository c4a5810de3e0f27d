"""The names of tpkit's parameters, in one place: the model's modules are named after
these, and every table that maps other names onto them (the Hugging Face family
recipes) writes them from here.

Every other use finds a parameter by walking `named_parameters()` and reading its
`tpkit.layers.sharding.ParamMeta`; these are looked up by name (tied embeddings across
pipeline stages, vocabulary padding, BERT's optional pooler, the family recipes).
"""

WORD = "embed.word"  # the vocab-parallel word embedding table [V_pad/tp, h]
POSITION = "embed.position"  # learned positions [max_seq_len, h]
TOKEN_TYPE = "embed.token_type"  # BERT's token types [type_vocab_size, h]
EMBED_NORM = "embed.norm"  # BERT's norm after the embeddings
FINAL_NORM = "final_norm"  # the norm before the head (pre-norm models)
HEAD = "head"  # the output projection when it has its own weight
POOLER = "pooler"  # BERT's pooler (the Transformer adds it when the family has one)

EMBED_WEIGHT = f"{WORD}.weight"
POSITION_WEIGHT = f"{POSITION}.weight"
TOKEN_TYPE_WEIGHT = f"{TOKEN_TYPE}.weight"
FINAL_NORM_WEIGHT = f"{FINAL_NORM}.weight"
HEAD_WEIGHT = f"{HEAD}.weight"
POOLER_WEIGHT = f"{POOLER}.weight"
VOCAB_PADDED = (EMBED_WEIGHT, HEAD_WEIGHT)  # rows past vocab_size are padding


def layer(i: int) -> str:
    """The module path of transformer layer `i` (global index, at any pipeline stage)."""
    return f"layers.{i}"
