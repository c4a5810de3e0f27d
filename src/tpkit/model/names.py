"""Names of the parameters that code outside the model refers to, in one place.

Every other parameter is found by walking `named_parameters()` and reading its
`tpkit.sharding.ParamMeta`; these few are looked up by name (tied embeddings across
pipeline stages, vocabulary padding, BERT's optional pooler).
"""

EMBED_WEIGHT = "embed.word.weight"  # the vocab-parallel word embedding table [V_pad/tp, h]
HEAD_WEIGHT = "head.weight"  # the output projection when it has its own weight
POOLER_WEIGHT = "pooler.weight"  # BERT's pooler (the Transformer adds it when the family has one)
VOCAB_PADDED = (EMBED_WEIGHT, HEAD_WEIGHT)  # rows past vocab_size are padding
