"""The decode-only forms of a model's modules, swapped in by `for_decode`: its linear
weights (below) and its norms (`NativeNorm`: one native call per row batch).

Weight-only int8 for decoding (`tpkit generate --quantize int8`, `tpkit serve`):
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

Without int8, a float32 or bfloat16 model's weights are reordered once for oneDNN
(`PackedWeight`), or kept as they are for the native products (`RowsWeight`);
`for_decode` does one of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.comm import all_reduce
from tpkit.comm.group import CommGroup
from tpkit.kernels import decode_ops
from tpkit.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpkit.layers.lora import merge_adapters
from tpkit.layers.norm import Norm
from tpkit.spec.config import QUANTIZE
from tpkit.spec.errors import UserError

KERNEL_K = 16  # _weight_int8pack_mm needs the input width to be a multiple of this
QMAX = 127


class NativeNorm(Norm):
    """A decode-only model's `Norm` (`for_decode` swaps the class in place: the same
    parameters and names): float32 and bfloat16 rows on the CPU in one native call
    (`kernels.decode_ops.norm`), anything else as `Norm` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., h] -> [..., h]."""
        if x.dtype == self.weight.dtype and x.device.type == "cpu":
            return decode_ops.norm(x, self.weight, self.bias, self.eps, self.offset)
        return super().forward(x)


class Int8Weight(nn.Module):
    """A weight [out, in] as int8 values `q` and bfloat16 row scales `scale` [out];
    `self(x)` is x [..., in] @ w^T -> [..., out] in x's dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("q", q.contiguous())  # [out, in] int8
        self.register_buffer("scale", scale.contiguous())  # [out] bfloat16
        self.fast = q.shape[1] % KERNEL_K == 0
        self.rows = decode_ops.Operand(self.q, self.scale) \
            if decode_ops.usable(self.q, torch.float32) else None  # <= ROWS rows: native

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

    @property
    def shape(self) -> torch.Size:
        """The weight's shape [out, in]."""
        return self.q.shape

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.rows is not None and decode_ops.fits(x):  # x as is, float sums
            return self.rows(x, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()  # [n, in]
        if self.fast:
            y = torch._weight_int8pack_mm(x2, self.q, self.scale)  # [n, out]
        else:
            y = F.linear(x2, self.q.to(torch.bfloat16) * self.scale[:, None])
        y = y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])
        return y if bias is None else y + bias

    def gated(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """silu(x gate^T) * (x up^T) in one call (`decode_ops`), or None where it cannot."""
        return _gated(self.rows, x, bias)

    def dequantized(self) -> torch.Tensor:
        """The weight it stands for, [out, in] float32 (q * scale)."""
        return self.q.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"int8 {list(self.q.shape)}, kernel={'int8pack' if self.fast else 'dequantized'}"


class PackedWeight(nn.Module):
    """A float32 or bfloat16 weight [out, in] reordered once into oneDNN's blocked
    layout, the one its matmul reads (what inductor's weight freezing does on CPU):
    `self(x, bias)` is `F.linear(x, w, bias)`. bfloat16: bit for bit, 1.4x faster at 1-8
    rows on the machine of docs/benchmarks.md (F.linear reorders the weight at every
    call). float32: the same dot products summed in another order, on every thread
    (MKL's matrix-vector product, F.linear's at one row, runs on one thread whatever
    torch's thread count, and at 2-8 rows it is ~3x slower than oneDNN's blocked
    kernel); the layout is chosen for `ROWS` rows (a decode step)."""

    ROWS = 8  # the rows oneDNN's layout is tuned for: a decode step of up to 8 sequences

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            w.detach().contiguous(), self.ROWS), persistent=False)
        self._shape = w.shape

    @staticmethod
    def available(dtype: torch.dtype | None) -> bool:
        """Can this machine's torch pack a weight of `dtype`? (float32 with oneDNN;
        bfloat16 with oneDNN's bf16 kernels.)"""
        if not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or (
            dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    @property
    def shape(self) -> torch.Size:
        """The weight's shape [out, in]."""
        return self._shape

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def gated(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """No fused gate here (`RowsWeight.gated`): None."""
        return None

    def extra_repr(self) -> str:
        return f"{list(self._shape)}, oneDNN blocked layout"


class RowsWeight(nn.Module):
    """A float32 or bfloat16 weight [out, in] kept as is for `kernels.decode_ops`: a call
    of at most `decode_ops.ROWS` rows (a decode step) is one native product, the weight
    read once on torch's threads; a longer one (a prompt) is `F.linear`."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.rows = decode_ops.Operand(w.detach())
        self.register_buffer("w", self.rows.w, persistent=False)
        # bfloat16 where torch has no bfloat16 kernels for this CPU (oneDNN's need
        # AVX-512 BF16 or AMX): its F.linear is ~6x float32's here (AVX2, 40 rows: 14 vs
        # 2.4 ms a layer of SmolLM2), so longer calls widen to float32 and the native
        # kernel takes up to WIDE_ROWS rows (16 rows: 1.4 ms, widening 3.3)
        self.widen = w.dtype == torch.bfloat16 and not PackedWeight.available(w.dtype)
        self.native_rows = decode_ops.WIDE_ROWS if self.widen else decode_ops.ROWS

    @property
    def shape(self) -> torch.Size:
        """The weight's shape [out, in]."""
        return self.w.shape

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != self.w.dtype:
            return F.linear(x, self.w, bias)
        if decode_ops.fits(x, self.native_rows):
            return self.rows(x, bias)
        if self.widen:  # bfloat16 without the CPU's bfloat16 products: float32 ones
            y = F.linear(x.float(), self.w.float(), None if bias is None else bias.float())
            return y.to(x.dtype)
        return F.linear(x, self.w, bias)

    def gated(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """silu(x gate^T) * (x up^T) in one call (`decode_ops`), or None where it cannot."""
        return _gated(self.rows, x, bias) if x.dtype == self.w.dtype else None

    def extra_repr(self) -> str:
        return f"{list(self.w.shape)}, native at <= {decode_ops.ROWS} rows"


def _gated(rows: decode_ops.Operand | None, x: torch.Tensor, bias: torch.Tensor | None
           ) -> torch.Tensor | None:
    if rows is None or not decode_ops.fits(x):
        return None
    return rows.gated(x, bias)


def decode_kind(w: torch.Tensor, quantize: str | None = None) -> str | None:
    """Which decode-only form a weight like `w` takes here: "int8", "rows" (the native
    products), "packed" (oneDNN, without the native library), or None (float16, or a CUDA
    weight, unquantized: it stays as it is)."""
    if quantize:
        return "int8"
    if decode_ops.usable(w, w.dtype):
        return "rows"
    return "packed" if PackedWeight.available(w.dtype) else None


def decode_form(w: torch.Tensor, quantize: str | None = None,
                group: CommGroup | None = None) -> nn.Module | None:
    """The decode-only form of a weight (`for_decode`, `decode_kind`), or None: keep it."""
    kind = decode_kind(w, quantize)
    if kind == "int8":
        return Int8Weight.of(w, group)
    return RowsWeight(w) if kind == "rows" else PackedWeight(w) if kind else None


def for_decode(model: nn.Module, quantize: str | None = None) -> nn.Module:
    """Make `model` decode-only, in place, on every tp rank alike: every column- and
    row-parallel linear weight (and the head) in the form this machine multiplies
    fastest, and the float weight gone (nothing trains it, nothing reads it):
    `quantize="int8"`: an `Int8Weight` (row-parallel layers all-reduce their row
    maxima: call it on every rank); else float32 and bfloat16 weights a `RowsWeight`
    (the native decode products, `kernels.decode_ops`) or, without that library, a
    `PackedWeight` where oneDNN takes them (float16 ones stay). Returns the model, in
    eval mode."""
    if quantize is not None and quantize not in QUANTIZE:
        raise UserError(f"quantize={quantize!r} is not one of {', '.join(QUANTIZE)}")
    merge_adapters(model)  # LoRA: W + s B A, decoded as one weight
    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    if not linears or decode_kind(linears[0][1].weight, quantize) is None:
        return model  # float16 (or a CUDA model) without quantizing: the weights stay
    model.eval()
    for name, m in linears:
        if m.sequence_parallel:
            raise UserError(f"{name}: decode-only weights run without sequence parallelism")
        row = isinstance(m, RowParallelLinear)
        m.decoding = decode_form(m.weight, quantize, m.group if row else None)
        del m.weight
    if decode_ops.load() is not None:  # the norms of float32 / bfloat16 rows: one call each
        for m in model.modules():
            if type(m) is Norm and m.weight.dtype in (torch.float32, torch.bfloat16) \
                    and m.weight.device.type == "cpu":
                m.__class__ = NativeNorm  # in place: its parameters, names and state dict
    if getattr(model, "is_last_stage", False) and hasattr(model, "head_weight"):
        w = model.head_weight  # whole rows: int8 has tp=1's scales
        model.head_decoding = decode_form(w, quantize)
        if getattr(model, "head", None) is not None:
            del model.head.weight  # untied: only the decoding copy is read
    return model
