"""The head and the vocab-parallel cross-entropy fused, chunk by chunk over tokens.

The plain path builds the logits of every token of the micro-batch at once:

    h [N, hid] --head--> logits [N, V/tp] --fp32--> softmax [N, V/tp]  (saved for backward)

For gpt2-124m at b*s = 2048 tokens that is 2048 x 50264 fp32 = 412 MB per copy, and
the loss holds several. Here only one chunk of `chunk` tokens exists at a time:

    forward,  per chunk c:  logits_c = h_c W^T          [c, V/tp]
                            3 all-reduces of c numbers  (max, target, sum of exp)
                            keep loss_c, max_c, sum_exp_c  (3 numbers per token)
    backward, per chunk c:  logits_c = h_c W^T again    (recomputed, nothing sent)
                            g_c = softmax_c - onehot    [c, V/tp]
                            dh_c = g_c W,  dW += g_c^T h_c

Still exactly the three small all-reduces per chunk of the plain loss (N numbers in
all), and the head's own collective: f (all-reduce of dh backward) or, with sequence
parallelism, the all-gather of h forward and the reduce-scatter of dh backward.
The cost: the head matmul runs once more (recomputed in backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpkit.comm import compile_ready, ops
from tpkit.comm.group import CommGroup
from tpkit.layers.cross_entropy import check_logits, logits_grad, shifted_exp, softmax_stats


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, n)) for a in range(0, n, chunk)]


def _chunk_grad(logits, target, group, vocab_size, ignore_index, eps, m, sum_exp, grad_loss):
    """d loss / d logits of one chunk [c, V/tp] (fp32) from its saved max and sum of exp."""
    p = shifted_exp(logits, group, vocab_size, m).div_(sum_exp.unsqueeze(-1))  # softmax
    return logits_grad(p, target, group, vocab_size, ignore_index, eps, grad_loss)


def _compiled(fn, backend: str | None):
    """`fn` itself, or under --compile its torch.compile'd form (the element-wise work
    over [c, V/tp] fused; the all-reduces inside stay graph breaks)."""
    if not backend:
        return fn
    compile_ready()  # the all-reduces: graph breaks
    return torch.compile(fn, backend=backend)


def _accumulate(dw: torch.Tensor, gt: torch.Tensor, h: torch.Tensor) -> None:
    """dw (fp32) += gt @ h, in place when the product is fp32 (no [V/tp, hid] temporary)."""
    if gt.dtype == dw.dtype:
        dw.addmm_(gt, h)
    else:  # bf16 product, summed in fp32 (a temporary of half the size)
        dw += gt.matmul(h)


class _ChunkedHeadCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, group, vocab_size, ignore_index, smoothing, chunk,
                backend):
        # h [N, hid] every token (after f or the SP gather); weight [V/tp, hid]; target [N]
        ctx.dtypes = (h.dtype, weight.dtype)
        if torch.is_autocast_enabled(h.device.type):  # cast once, save the cast copies
            dt = torch.get_autocast_dtype(h.device.type)
            h, weight = h.to(dt), weight.to(dt)
        h = h.to(weight.dtype)  # a bf16 head (master weights) takes the fp32 hidden states
        loss, m, sum_exp = (torch.empty(h.shape[0], device=h.device) for _ in range(3))  # [N]
        args, stats = (group, vocab_size, ignore_index), _compiled(softmax_stats, backend)
        for a, b in _spans(h.shape[0], chunk):
            logits = F.linear(h[a:b], weight)  # [c, V/tp], the only one alive
            loss[a:b], _, m[a:b], sum_exp[a:b] = stats(logits, target[a:b], *args, smoothing)
        ctx.save_for_backward(h, weight, target, m, sum_exp)
        ctx.args, ctx.smoothing, ctx.chunk, ctx.backend = args, smoothing, chunk, backend
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        h, w, target, m, sum_exp = ctx.saved_tensors
        group, vocab_size, ignore_index = ctx.args
        dh = torch.empty_like(h)  # [N, hid]
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) \
            if ctx.needs_input_grad[1] else None  # [V/tp, hid], fp32 sum; frozen (LoRA): none
        chunk_grad = _compiled(_chunk_grad, ctx.backend)
        for a, b in _spans(h.shape[0], ctx.chunk):
            logits = F.linear(h[a:b], w)  # [c, V/tp], recomputed
            g = chunk_grad(logits, target[a:b], group, vocab_size, ignore_index, ctx.smoothing,
                           m[a:b], sum_exp[a:b], grad_loss[a:b]).to(w.dtype)  # [c, V/tp]
            dh[a:b] = g.matmul(w)  # [c, hid]
            if dw is not None:
                _accumulate(dw, g.t(), h[a:b])  # [V/tp, hid]
        h_dtype, w_dtype = ctx.dtypes
        dw = dw if dw is None else dw.to(w_dtype)
        return dh.to(h_dtype), dw, None, None, None, None, None, None, None


def chunked_head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               group: CommGroup, vocab_size: int, *, chunk: int,
                               sequence_parallel: bool = False, ignore_index: int = -100,
                               label_smoothing: float = 0.0,
                               compile_backend: str | None = None) -> torch.Tensor:
    """Per-token losses [b, s] of the vocab-parallel head `weight` [V_pad/tp, hid] applied to
    the final hidden states h [b, s, hid] ([b, s/tp, hid] with SP), `chunk` tokens at a time.

    Equal to `vocab_parallel_cross_entropy(column_parallel_linear(h, weight), ...)` to
    float round-off; its peak memory is that of one chunk's logits. `compile_backend`
    compiles the per-chunk element-wise work (`tpkit train --compile`).
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} tokens: the chunked loss needs at least 1")
    check_logits(weight.shape[0], group, vocab_size, label_smoothing)
    with group.ledger.scope("head"), ops.sequence(group, target.shape[-1]):  # SP: its parts
        x = ops.gather_from_sp(h, group) if sequence_parallel else ops.copy_to_tp(h, group)
    b, s, hid = x.shape  # [b, s, hid], every token
    if target.shape != (b, s):
        raise ValueError(f"labels of shape {tuple(target.shape)} do not match the hidden "
                         f"states' {b} x {s} tokens")
    with group.ledger.scope("loss"):
        loss = _ChunkedHeadCE.apply(x.reshape(b * s, hid), weight, target.reshape(b * s), group,
                                    vocab_size, ignore_index, float(label_smoothing), chunk,
                                    compile_backend)
    return loss.view(b, s)  # [b, s]
