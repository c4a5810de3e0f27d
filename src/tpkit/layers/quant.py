"""Weight-only int8 for decoding (`tpkit generate --quantize int8`, `tpkit serve`):
each linear weight [out, in] becomes int8 with one scale per output row,

    w ~ q * scale[:, None]      q = round(w / scale) in [-127, 127],  scale = max|w_row| / 127

a quarter of float32's bytes to stream per token. The product runs in torch's CPU
kernel `_weight_int8pack_mm` (int8 weights dequantized inside the matmul, bfloat16
activations, float accumulation): a float32 model's activations are rounded to
bfloat16 on the way in and the output comes back in the model's dtype. Where the kernel
cannot run (an input width not a multiple of 16: it reads garbage there, torch 2.13)
the same int8 values are multiplied as a dequantized bfloat16 matrix: the same
quantization, only slower.

Sharded exactly as the float weights are, after loading (`quantize(model, "int8")`):
a column-parallel shard holds whole rows, so its scales are tp=1's; a row-parallel
shard holds a slice of every row, so the row's max |w| is taken over the tp group
first (one all-reduce of [out] at load time): every rank's int8 values are then tp=1's
slices of the same q, at any tp. The head (tied to the embedding or not) gets its own
int8 copy; the embedding table stays in the model's dtype (a lookup reads one row).

Inference only: a quantized model has no float weights to train.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.comm import all_reduce
from tpkit.comm.group import CommGroup
from tpkit.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpkit.spec.config import QUANTIZE
from tpkit.spec.errors import UserError

KERNEL_K = 16  # _weight_int8pack_mm needs the input width to be a multiple of this
QMAX = 127


class Int8Weight(nn.Module):
    """A weight [out, in] as int8 values `q` and bfloat16 row scales `scale` [out];
    `self(x)` is x [..., in] @ w^T -> [..., out] in x's dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("q", q.contiguous())  # [out, in] int8
        self.register_buffer("scale", scale.contiguous())  # [out] bfloat16
        self.fast = q.shape[1] % KERNEL_K == 0

    @classmethod
    def of(cls, w: torch.Tensor, group: CommGroup | None = None) -> Int8Weight:
        """Quantize `w` [out, in]; `group`: w holds a slice of every row over that group
        (row-parallel), so each row's max |w| is taken over it."""
        amax = w.detach().abs().amax(1).float()  # [out]
        if group is not None and group.size > 1:
            amax = all_reduce(amax, group, "max", phase="quantize")
        scale = (amax / QMAX).clamp(min=torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        q = torch.round(w.detach().float() / scale.float()[:, None]).clamp(-QMAX, QMAX)
        return cls(q.to(torch.int8), scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()  # [n, in]
        if self.fast:
            y = torch._weight_int8pack_mm(x2, self.q, self.scale)  # [n, out]
        else:
            y = F.linear(x2, self.q.to(torch.bfloat16) * self.scale[:, None])
        return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])

    def dequantized(self) -> torch.Tensor:
        """The weight it stands for, [out, in] float32 (q * scale)."""
        return self.q.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"int8 {list(self.q.shape)}, kernel={'int8pack' if self.fast else 'dequantized'}"


def quantize(model: nn.Module, how: str | None) -> nn.Module:
    """Replace every column- and row-parallel linear weight of `model` (and its head) by
    an `Int8Weight`, in place, on every tp rank alike (row-parallel layers all-reduce
    their row maxima: call it on every rank). `how` None: nothing. Returns the model
    (in eval mode: a quantized model only decodes)."""
    if how is None:
        return model
    if how not in QUANTIZE:
        raise UserError(f"quantize={how!r} is not one of {', '.join(QUANTIZE)}")
    model.eval()
    for name, m in model.named_modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear):
            if m.sequence_parallel:
                raise UserError(f"{name}: int8 weights decode without sequence parallelism")
            row = isinstance(m, RowParallelLinear)
            m.int8 = Int8Weight.of(m.weight, m.group if row else None)
            del m.weight  # the float weight is gone: nothing trains it, nothing reads it
    if getattr(model, "is_last_stage", False) and hasattr(model, "head_weight"):
        model.head_int8 = Int8Weight.of(model.head_weight)  # whole rows: tp=1's scales
        if getattr(model, "head", None) is not None:
            del model.head.weight  # untied: only the int8 copy is read
    return model
