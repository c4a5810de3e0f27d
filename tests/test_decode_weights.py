"""Decode-only weights (`tpkit.layers.quant.for_decode`, `PackedWeight`).

Math checked: a bfloat16 weight packed for oneDNN gives F.linear's products bit for bit
(the same kernel, the weight reordered once instead of at every call). A float32 one
gives every output as the same dot product of K terms summed in another order: within
K float32 rounding units of F.linear's relative to sum |x_i w_i| (bounded here by
2^-23 * K * max |x| |w| summed; 1e-5 relative at K <= 1536). A decode-only model
(`load_model(decode=True)`) gives the same greedy tokens as the trainable one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_folders import tiny_llama_folder
from tpkit.layers.quant import PackedWeight
from tpkit.serve import Engine, SamplingParams
from tpkit.weights.sources import load_model, open_source


@pytest.mark.skipif(not PackedWeight.available(torch.float32),
                    reason="this torch has no oneDNN to pack for")
@pytest.mark.parametrize("rows", [1, 3, PackedWeight.ROWS, 33])
def test_packed_float32_weight_is_f_linear_within_k_roundings(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(2, rows, 40, generator=g)
    p = PackedWeight(w)
    got, want = p(x, b), F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    scale = (x.abs() @ w.abs().t() + b.abs()).max()
    assert ((got - want).abs().max() / scale) <= 40 * 2.0 ** -23
    assert ((p(x) - F.linear(x, w)).abs().max() / scale) <= 40 * 2.0 ** -23


@pytest.mark.skipif(not PackedWeight.available(torch.bfloat16),
                    reason="this torch has no oneDNN bfloat16 kernels to pack for")
def test_packed_bfloat16_weight_is_f_linear_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    p = PackedWeight(w)
    assert p.shape == w.shape
    for rows in (1, 5, 33):
        x = torch.randn(2, rows, 64, generator=g).to(torch.bfloat16)
        assert torch.equal(p(x, b), F.linear(x, w, b))
        assert torch.equal(p(x), F.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_model_gives_the_same_tokens(tmp_path, dtype):
    path = tiny_llama_folder(tmp_path / "llama", initializer_range=0.3)
    tokens = {}
    for decode in (False, True):
        model = load_model(open_source(path), dtype=dtype, decode=decode)
        if decode and PackedWeight.available(dtype):
            assert isinstance(model.layers[next(iter(model.layers))].mlp.fc2.decoding, PackedWeight)
            assert not hasattr(model.layers[next(iter(model.layers))].mlp.fc2, "weight")
        engine = Engine(model, max_batch=4, max_len=64)
        reqs = engine.generate([[1, 40, 7, 150], [1, 9, 3]],
                               SamplingParams(max_tokens=12, ignore_eos=True))
        tokens[decode] = [r.tokens for r in reqs]
        engine.runner.lead_stop()
    assert tokens[True] == tokens[False]
