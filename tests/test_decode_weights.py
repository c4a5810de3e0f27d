"""Decode-only weights (`tpkit.decode.forms.for_decode`, `RowsWeight`, `PackedWeight`).

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
from tpkit.decode.forms import PackedWeight, RowsWeight
from tpkit.kernels import decode_ops
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


TIE = 4 * 2.0 ** -4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_model_gives_the_same_tokens(tmp_path, dtype):
    """float32: the same greedy tokens. bfloat16: the decode-only model's products round
    once where the trainable one's round per op (and sum in another order), so on this
    random model (near-flat logits) a greedy choice may flip at a near tie: the tokens
    are the same up to the first place the trainable model's two likeliest are within
    bfloat16 rounding of each other, and every log-probability before it agrees: within
    TIE = 4 bfloat16 units of a logit of 8-16 (2^-4 each; the logits are rounded to
    bfloat16 by the head)."""
    path = tiny_llama_folder(tmp_path / "llama", initializer_range=0.3)
    out = {}
    for decode in (False, True):
        model = load_model(open_source(path), dtype=dtype, decode=decode)
        fc2 = model.layers[next(iter(model.layers))].mlp.fc2
        if decode and decode_ops.load() is not None:  # the native decode products
            assert isinstance(fc2.decoding, RowsWeight) and not hasattr(fc2, "weight")
        elif decode and PackedWeight.available(dtype):
            assert isinstance(fc2.decoding, PackedWeight) and not hasattr(fc2, "weight")
        engine = Engine(model, max_batch=4, max_len=64)
        out[decode] = engine.generate([[1, 40, 7, 150], [1, 9, 3]],
                                      SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2))
        engine.runner.lead_stop()
    for want, got in zip(out[False], out[True]):
        if dtype == torch.float32:
            assert got.tokens == want.tokens
            continue
        same = next((i for i, (a, b) in enumerate(zip(want.tokens, got.tokens)) if a != b),
                    len(want.tokens))
        assert same >= 3, (want.tokens, got.tokens)  # not a wholesale difference
        assert max(abs(a - b) for a, b in zip(want.logprobs[:same], got.logprobs[:same])) < TIE
        if same < len(want.tokens):  # a near tie in the reference's own logits
            (_, first), (_, second) = want.top[same][:2]
            assert first - second < TIE, (same, want.top[same])
