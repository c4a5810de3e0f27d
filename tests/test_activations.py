"""The planner's activation memory is the block's saved tensors: the formula of
`tpkit.plan.activations` against the bytes torch's autograd really keeps for one
layer of tpkit's model (counted with `torch.autograd.graph.saved_tensors_hooks`,
each storage once, parameters excluded).

Tolerance 3%: the formula leaves out RoPE's cos/sin tables (2 s d floats per layer,
shared by every head and micro-batch), which are 1-2% of these tiny layers."""

from __future__ import annotations

import pytest
import torch

from tpkit.mesh import ParallelMesh
from tpkit.model.block import Block
from tpkit.plan.activations import layer_activation_bytes, saved_tensors
from tpkit.spec.config import get_preset


def measured_saved_bytes(cfg, b: int, s: int) -> int:
    """Bytes of every distinct non-parameter storage autograd saves in one block's forward."""
    torch.manual_seed(0)
    block = Block(cfg, ParallelMesh.single().tp_group, layer_index=0)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(b, s, cfg.hidden, requires_grad=True)  # [b, s, h]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize("name,changes", [
    ("gpt2-tiny", {}),                                  # LayerNorm, GeLU, MHA
    ("llama-tiny", {}),                                 # RMSNorm, SwiGLU, GQA 8:2, RoPE
    ("llama-tiny", dict(hidden=128, ffn=352)),   # another SwiGLU ratio
    ("gpt2-tiny", dict(kv_heads=1)),                # MQA
])
def test_formula_matches_the_tensors_the_block_saves(name, changes):
    cfg = get_preset(name).with_(**changes)
    b, s = 2, 64
    got = measured_saved_bytes(cfg, b, s)
    want = layer_activation_bytes(cfg, s, b, act_bytes=4, flash=True, kernels="eager")
    assert want == pytest.approx(got, rel=0.03), saved_tensors(cfg, s, b, act_bytes=4,
                                                                kernels="eager")


def test_swiglu_and_gqa_change_the_split_not_a_constant():
    """Llama 3 70B (h 8192, f 28672, 64 heads, 8 kv heads, fused kernels) keeps, in 2-byte
    s b h units: norm inputs and outputs 8, q 2, k and v 2 * 2 * 8/64 = 0.5, attention
    output 2, SwiGLU 3 * 2 * 3.5 = 21: 33.5 (GPT-3's formula says 34), of which only 8 stay
    replicated over tp without SP (GPT-3's says 10): at tp = 8, 11.2 s b h, not 13."""
    c = get_preset("llama3-70b")
    s, b = 8192, 1
    sbh = s * b * c.hidden
    stats, lse = 2 * s * b * 4, 64 * s * b * 4  # RMSNorm rstd (2 norms), flash LSE, fp32
    one = layer_activation_bytes(c, s, b, tp=1) - stats - lse
    assert one == pytest.approx((8 + 2 + 0.5 + 2 + 21) * sbh)
    eight = layer_activation_bytes(c, s, b, tp=8) - stats - lse / 8
    assert eight == pytest.approx((8 + 25.5 / 8) * sbh)
    gpt = get_preset("gpt2-124m").with_(dropout=0.1)  # no flash, dropout: Korthikanti's 34
    no_flash = layer_activation_bytes(gpt, 1024, 1, flash=False)
    sbh, stats = 1024 * gpt.hidden, 4 * 1024 * 4  # LayerNorm mean and rstd, 2 norms
    assert no_flash - stats == pytest.approx(sbh * (34 + 5 * 12 * 1024 / 768))


def test_flash_attention_never_keeps_the_scores_whatever_the_recompute_mode():
    c = get_preset("llama3-405b")
    s, b = 8192, 1
    for recompute in ("none", "selective"):
        kept = saved_tensors(c, s, b, tp=8, sp=True, recompute=recompute)
        assert "softmax output" not in kept
        assert kept == saved_tensors(c, s, b, tp=8, sp=True, recompute="selective")
    no_flash = saved_tensors(c, s, b, tp=8, sp=True, recompute="none", flash=False)
    assert no_flash["softmax output"] == 16 * s * s * b * 2  # a/t heads of s x s, bf16


class _SwiGLUKeepingGateUp(torch.autograd.Function):
    """The contract of xformers' fused SwiGLU (`xformers.ops.SwiGLU`, Meta's): the forward
    saves its input, the weights and the two fc1 outputs; the backward recomputes
    silu(gate) * up, the fc2 input, for fc2's weight gradient."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3):
        x1, x2 = x @ w1.t(), x @ w2.t()
        ctx.save_for_backward(x, w1, w2, w3, x1, x2)
        return (torch.nn.functional.silu(x1) * x2) @ w3.t()

    @staticmethod
    def backward(ctx, dx5):
        x, w1, w2, w3, x1, x2 = ctx.saved_tensors
        sig = torch.sigmoid(x1)
        silu = x1 * sig
        dx4 = dx5 @ w3
        dx1, dx2 = dx4 * x2 * sig * (1 + x1 * (1 - sig)), dx4 * silu
        return dx1 @ w1 + dx2 @ w2, dx1.t() @ x, dx2.t() @ x, dx5.t() @ (silu * x2)


def test_xformers_swiglu_keeps_gate_and_up_only_and_is_exact():
    """`kernels="xformers"`: the MLP term is the bytes that op's contract saves beyond its
    input (the norm output, counted with the norms), and recomputing the product in the
    backward gives autograd's gradients."""
    cfg = get_preset("llama-tiny")
    s, f, h = 64, cfg.ffn, cfg.hidden
    torch.manual_seed(0)
    x = torch.randn(s, h, dtype=torch.float64, requires_grad=True)
    ws = [(torch.randn(o, i, dtype=torch.float64) / i ** 0.5).requires_grad_()
          for o, i in ((f, h), (f, h), (h, f))]  # gate, up, down
    kept: dict[int, int] = {}
    weights = {w.untyped_storage().data_ptr() for w in [x, *ws]}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _SwiGLUKeepingGateUp.apply(x, *ws)
    want = saved_tensors(cfg, s, 1, act_bytes=8, kernels="xformers")
    assert sum(kept.values()) == want["MLP (gate|up, silu, fc2 input)"]
    grads = torch.autograd.grad(out.square().sum(), [x, *ws])
    x1, x2 = x @ ws[0].t(), x @ ws[1].t()
    ref = ((torch.nn.functional.silu(x1) * x2) @ ws[2].t()).square().sum()
    for got, exp in zip(grads, torch.autograd.grad(ref, [x, *ws])):  # float64: ~1e-16
        assert (got - exp).abs().max() <= 1e-12 * exp.abs().max()
