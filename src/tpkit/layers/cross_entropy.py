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

`softmax_stats` (the forward, with its three all-reduces) and `logits_grad` (the
backward, none) are shared with the chunked loss (`tpkit.layers.chunked_loss`),
which rebuilds each chunk's softmax from the saved max and sum of exp.
"""

from __future__ import annotations

import torch

from tpkit.comm import all_reduce
from tpkit.comm.group import CommGroup


def _columns(logits: torch.Tensor, group: CommGroup, vocab_size: int):
    """(first global column of this rank, mask of its real (unpadded) columns [V/tp])."""
    per_rank = logits.shape[-1]
    start = group.rank * per_rank
    cols = torch.arange(start, start + per_rank, device=logits.device)
    return start, cols < vocab_size


def _owned_targets(target: torch.Tensor, start: int, per_rank: int, ignore_index: int):
    """(target's local column, clamped; mask of the tokens whose target this rank owns)."""
    local_t = target - start
    mine = (local_t >= 0) & (local_t < per_rank) & (target != ignore_index)
    return local_t.clamp(0, per_rank - 1), mine


def _masked(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return logits.float().masked_fill(~valid, float("-inf"))  # [.., V/tp], fp32


def shifted_exp(logits: torch.Tensor, group: CommGroup, vocab_size: int,
                m: torch.Tensor) -> torch.Tensor:
    """exp(logit - global max) in fp32 [.., V/tp]; padded columns 0."""
    _, valid = _columns(logits, group, vocab_size)
    return _masked(logits, valid).sub_(m.unsqueeze(-1)).exp_()  # padded: exp(-inf) = 0


def softmax_stats(logits, target, group: CommGroup, vocab_size: int, ignore_index: int,
                  smoothing: float):
    """The forward and its three all-reduces: (per-token loss, exp(logit - max), max,
    sum of exp); the last two rebuild the softmax without sending anything."""
    per_rank = logits.shape[-1]
    start, valid = _columns(logits, group, vocab_size)
    x = _masked(logits, valid)  # [b, s, V/tp]
    m = x.max(dim=-1).values  # [b, s]
    all_reduce(m, group, op="max")  # 1
    x = x - m.unsqueeze(-1)
    local_t, mine = _owned_targets(target, start, per_rank, ignore_index)
    picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
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
    return loss.masked_fill(target == ignore_index, 0.0), exp, m, sum_exp


def logits_grad(softmax: torch.Tensor, target, group: CommGroup, vocab_size: int,
                ignore_index: int, eps: float, grad_loss: torch.Tensor) -> torch.Tensor:
    """d loss / d logit = (softmax - (1-eps) onehot - eps/V) * grad_loss, 0 for ignored
    tokens and padded columns; overwrites `softmax` [.., V/tp] (fp32)."""
    start, valid = _columns(softmax, group, vocab_size)
    local_t, mine = _owned_targets(target, start, softmax.shape[-1], ignore_index)
    g = softmax
    g.scatter_add_(-1, local_t.unsqueeze(-1), -(1 - eps) * mine.unsqueeze(-1).to(g.dtype))
    if eps:
        g -= (eps / vocab_size) * valid
    return g.masked_fill_((target == ignore_index).unsqueeze(-1), 0.0).mul_(
        grad_loss.unsqueeze(-1))


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, smoothing):
        loss, exp, _, sum_exp = softmax_stats(logits, target, group, vocab_size, ignore_index,
                                              smoothing)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), target)
        ctx.args = (group, vocab_size, ignore_index, smoothing)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, target = ctx.saved_tensors
        g = logits_grad(softmax.clone(), target, *ctx.args, grad_loss)
        return g.to(ctx.dtype), None, None, None, None, None


def check_logits(per_rank: int, group: CommGroup, vocab_size: int,
                 label_smoothing: float) -> None:
    """One clear error for logits that are not this rank's vocab-parallel slice."""
    tp = group.size
    if tp > 1 and per_rank >= vocab_size:
        raise ValueError(f"logits have {per_rank} vocabulary columns, the whole vocabulary of "
                         f"{vocab_size}: they look already gathered; pass this rank's "
                         f"vocab-parallel slice (about {vocab_size}/{tp} columns)")
    if per_rank * tp < vocab_size:
        raise ValueError(f"logits have {per_rank} vocabulary columns: {tp} ranks x {per_rank} "
                         f"do not cover the vocabulary of {vocab_size}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: CommGroup,
                                 vocab_size: int, *, ignore_index: int = -100,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token losses [b, s] from this rank's logits [b, s, V_pad/tp].

    `vocab_size` is the real (unpadded) global vocabulary. Ignored tokens get loss 0.
    """
    check_logits(logits.shape[-1], group, vocab_size, label_smoothing)
    return _VocabParallelCE.apply(logits, target, group, vocab_size, ignore_index,
                                  float(label_smoothing))
