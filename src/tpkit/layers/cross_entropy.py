"""Cross-entropy on logits split by vocabulary (Megatron-LM's cross_entropy.py idea).

The logits [b, s, V_pad/tp] are never gathered (V_pad * b * s floats would be the
largest tensor of the step). Three all-reduces of b*s numbers instead:

    1. max over the vocabulary            (all-reduce max: a stable softmax)
    2. the target's logit                 (all-reduce sum: one rank owns the target)
    3. sum of exp(logit - max)            (all-reduce sum)
    loss = log(sum_exp) - target_logit

Label smoothing needs the mean logit over the *global* vocabulary; its sum rides in
the same all-reduce as the target logit (summing over the local slice alone is a
common bug). Padded vocabulary columns (V_pad > V) are kept out of the softmax.
"""

from __future__ import annotations

import torch

from tpkit.comm import all_reduce
from tpkit.comm.group import CommGroup


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, smoothing):
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        cols = torch.arange(start, start + per_rank, device=logits.device)
        valid = cols < vocab_size  # [V/tp]: padded columns are not words
        x = logits.float().masked_fill(~valid, float("-inf"))  # [b, s, V/tp]
        m = x.max(dim=-1).values  # [b, s]
        all_reduce(m, group, op="max")  # 1
        x = x - m.unsqueeze(-1)
        local_t = target - start
        mine = (local_t >= 0) & (local_t < per_rank) & (target != ignore_index)
        picked = x.gather(-1, local_t.clamp(0, per_rank - 1).unsqueeze(-1)).squeeze(-1)
        sums = torch.stack([picked.masked_fill(~mine, 0.0),
                            x.masked_fill(~valid, 0.0).sum(-1)]) if smoothing else \
            picked.masked_fill(~mine, 0.0).unsqueeze(0)  # [1 or 2, b, s]
        all_reduce(sums, group)  # 2: target logit (and sum of logits, for smoothing)
        exp = x.exp()  # padded columns: exp(-inf) = 0
        sum_exp = exp.sum(-1)
        all_reduce(sum_exp, group)  # 3
        log_z = sum_exp.log()
        loss = log_z - sums[0]
        if smoothing:
            loss = (1 - smoothing) * loss + smoothing * (log_z - sums[1] / vocab_size)
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, mine, ignored, valid)
        ctx.smoothing, ctx.vocab_size, ctx.dtype = smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, ignored, valid = ctx.saved_tensors
        eps = ctx.smoothing
        g = softmax.clone()  # d loss / d logit = softmax - (1-eps) onehot - eps/V
        onehot = torch.zeros_like(g).scatter_(-1, local_t.clamp(0, g.shape[-1] - 1).unsqueeze(-1),
                                              1.0) * mine.unsqueeze(-1)
        g -= (1 - eps) * onehot
        if eps:
            g -= (eps / ctx.vocab_size) * valid
        g = g.masked_fill(ignored.unsqueeze(-1), 0.0) * grad_loss.unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: CommGroup,
                                 vocab_size: int, *, ignore_index: int = -100,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token losses [b, s] from this rank's logits [b, s, V_pad/tp].

    `vocab_size` is the real (unpadded) global vocabulary. Ignored tokens get loss 0.
    """
    tp, per_rank = group.size, logits.shape[-1]
    if tp > 1 and per_rank >= vocab_size:
        raise ValueError(f"logits have {per_rank} vocabulary columns, the whole vocabulary of "
                         f"{vocab_size}: they look already gathered; pass this rank's "
                         f"vocab-parallel slice (about {vocab_size}/{tp} columns)")
    if per_rank * tp < vocab_size:
        raise ValueError(f"logits have {per_rank} vocabulary columns: {tp} ranks x {per_rank} "
                         f"do not cover the vocabulary of {vocab_size}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    return _VocabParallelCE.apply(logits, target, group, vocab_size, ignore_index,
                                  float(label_smoothing))
