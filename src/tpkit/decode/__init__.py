"""The decode wing: a model's forward over a paged KV cache, and generation.

    paged_kv   the paged cache (`PagedCache`), one forward of any mix of sequences
               (`forward`, `ready`), each layer's cache (`PagedKV`: what a layer's
               modules are handed as `kv_cache`)
    attend     the rows' attention over the cache (`PagedBatch`, `attend_paged`)
    native     a decode-only layer's rows on the native kernels alone (`NativeLayer`),
               every layer in one native call (`NativeStack`, `NativeEnds`)
    stacks     which of those a model takes, decided once per model (`greedy_ready`)
    forms      the decode-only forms of the modules (`for_decode`: int8 / native /
               oneDNN weights, `NativeNorm`)
    sampling   the next token from logits (greedy, temperature, top-k, top-p)
    generate   `model.generate` of the Python API

It knows the model by its modules (their attributes), never by importing it: it sits
below `tpkit.model` (whose `Transformer.generate` calls `generate`) and above
`tpkit.layers` and `tpkit.kernels`. `tpkit.serve`'s engine runs on `paged_kv` too.
"""
