"""Decode-only weights (`tpkit.layers.quant.for_decode`, `tpkit.layers.linear.dense`).

Math checked: a float32 product of at most SPLIT_ROWS rows without gradients runs as
one batched matmul of the weight cut into a block of rows per thread: every output is
the same dot product of K terms, summed in another order, so it is within K float32
rounding units of F.linear's relative to sum |x_i w_i| (bounded here by 2^-23 * K *
max |x| |w| summed, in relative terms 1e-5 at K <= 1536). A bfloat16 weight packed for
oneDNN gives F.linear's products bit for bit (the same kernel, the weight reordered once
instead of at every call). A decode-only model (`load_model(decode=True)`) gives the
same greedy tokens as the trainable one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_folders import tiny_llama_folder
from tpkit.layers.linear import SPLIT_ROWS, dense
from tpkit.layers.quant import PackedWeight
from tpkit.serve import Engine, SamplingParams
from tpkit.weights.sources import load_model, open_source


def _ops(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("rows", [1, 3, SPLIT_ROWS, SPLIT_ROWS + 1])
def test_dense_splits_small_float32_products_over_threads(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(1, rows, 40, generator=g)
    want = F.linear(x, w, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.no_grad():
            got = dense(x, w, b)
            ops = _ops(lambda: dense(x, w, b))
        assert got.shape == want.shape
        scale = (x.abs() @ w.abs().t() + b.abs()).max()
        assert ((got - want).abs().max() / scale) <= 40 * 2.0 ** -23
        assert ("aten::bmm" in ops) == (rows <= SPLIT_ROWS)  # the split ran, and only there
        with torch.enable_grad():  # a product that needs gradients is F.linear's own
            assert "aten::bmm" not in _ops(lambda: dense(x, w.requires_grad_(), b))
        torch.set_num_threads(1)
        with torch.no_grad():  # one thread: F.linear itself
            assert torch.equal(dense(x, w.detach(), b), F.linear(x, w.detach(), b))
    finally:
        torch.set_num_threads(threads)


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
