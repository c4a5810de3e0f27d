"""The decode step's native kernels (C++ through ctypes) and their Python bindings:

    decode_ops        a decode step's products, norms, rotary + cache writes, the layer
                      stack in one call, the greedy ends (decode_ops.cpp, decode_simd.h,
                      decode_layers.h)
    paged_attention   the decode rows' attention over the paged KV cache
                      (paged_attention.cpp)

Both are built by `make` after installing (or on first use) into `_native_build/` next
to them (git-ignored); without a compiler `load()` gives None and the decode runs on
torch. Nothing here knows the model: the decode forward calls them.
"""
