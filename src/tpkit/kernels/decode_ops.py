"""A decode step's products in one native call each: a few rows times a weight read once.

    y = decode_ops.linear(x, w, bias, scale=None, gate=False)   # x [M, K], w [N, K]

y [M, N] = x @ w^T (* scale) + bias, or with `gate` (SwiGLU's fused [gate; up] weight of
2F rows) y [M, F] = silu(x @ gate^T) * (x @ up^T), the activation fused into the product.
w float32, bfloat16 or int8 (with `scale` [N] float32: int8's row scales); x, y and the
bias float32 or bfloat16. Every sum is float32; y is rounded once to x's dtype.

Why: at one to eight rows a decode's products read the weights once and do little
arithmetic; what costs is each call's fixed overhead (oneDNN's ~20 us per small product
measured on the machine of docs/benchmarks.md, 120 products a token for a 30-layer
model) and the threads. This kernel hands the output columns to torch's own OpenMP team
(the workers spinning after every torch op) in one call with no reorder and no
allocation, and fuses what follows a product where the layer lets it (the bias, the
row scales of int8, SwiGLU's gate).

Guarantees:
- Batch invariance by construction: y[m, n] is one dot product summed in a fixed order
  (L lanes of fused multiply-adds over k, a fixed tree, the remainder in order), the
  same whatever the other rows, the thread count or which thread computes it. L is the
  CPU's vector width (16 with AVX-512, else 8): bits are per machine, like the library.
- Accuracy: float32 sums of exact products of widened values: within K float32
  roundings of F.linear (tests/test_decode_ops.py).

Used by the decode-only weights (`decode.forms`) for calls of at most `ROWS` rows (a
decode step); longer pieces (a prompt) keep torch's matmuls. Without the library (no
compiler, a CUDA tensor, float16, TPKIT_DECODE_OPS_DISABLE=1) `usable` is False and every call
keeps torch's matmul.

    python -m tpkit.kernels.decode_ops   # build it (what `make` runs after installing)
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import numpy as np
import torch

from tpkit.comm.native import NativeLibrary

ROWS = 8  # calls of at most this many rows take the kernel
WIDE_ROWS = 32  # ... bfloat16 ones where torch's own bfloat16 products are slow (`RowsWeight`)
SOURCE = Path(__file__).with_name("decode_ops.cpp")  # + the two headers it includes
LIBRARY = NativeLibrary(
    "decode_ops", (SOURCE, *(SOURCE.with_name(h) for h in ("decode_simd.h", "decode_layers.h",
                                                           "native_common.h"))),
    Path(__file__).with_name("_native_build"),
    ("-O3", "-march=native", "-std=c++17", "-ffp-contract=fast", "-shared", "-fPIC",
     "-fno-strict-aliasing"),
    signatures={name: (None, ctypes.c_int) for name in  # ctypes objects passed
                ("tpk_linear", "tpk_norm", "tpk_rope_write", "tpk_layers", "tpk_best",
                 "tpk_pick", "tpk_allowed")},
    disable_env="TPKIT_DECODE_OPS_DISABLE", per_cpu=True)
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
NULL = ctypes.c_void_p(None)
INTS = [ctypes.c_int(i) for i in range(257)]  # small int arguments, made once


@functools.lru_cache(maxsize=1)  # one load per process
def load() -> ctypes.CDLL | None:
    """The loaded kernel, or None (no compiler, or TPKIT_DECODE_OPS_DISABLE=1)."""
    return LIBRARY.open()


def usable(w: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel takes a weight `w` with activations of `dtype`."""
    return (w.device.type == "cpu" and w.dtype in DTYPES and dtype in (torch.float32,
            torch.bfloat16) and w.is_contiguous() and load() is not None)


def fits(x: torch.Tensor, rows: int = ROWS) -> bool:
    """Whether a call on x [..., K] takes the kernel: at most `rows` rows, on the CPU, of a
    dtype it takes."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.numel() <= rows * x.shape[-1])


class Operand:
    """A weight (and its int8 scales, its bias) held for the kernel: the pointers made
    once, the tensors kept alive."""

    def __init__(self, w: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        self.w, self.scale = w.contiguous(), scale
        if scale is not None:
            self.scale = scale.float().contiguous()
        self.n, self.k = self.w.shape
        self.args = (ctypes.c_void_p(self.w.data_ptr()),
                     NULL if self.scale is None else ctypes.c_void_p(self.scale.data_ptr()))
        self.sizes = (ctypes.c_int64(self.k), ctypes.c_int64(self.n))
        self.wdtype = INTS[DTYPES[self.w.dtype]]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, threads: int | None = None
                 ) -> torch.Tensor:
        """x [..., K] (float32 or bfloat16) -> residual + (x w^T + bias) [..., N] in x's
        dtype (residual [..., N] contiguous, or None)."""
        return self._run(x, bias, False, threads, residual)

    def gated(self, x: torch.Tensor, bias: torch.Tensor | None = None,
              threads: int | None = None) -> torch.Tensor:
        """x [..., K] -> silu(x gate^T + b_gate) * (x up^T + b_up) [..., N/2]: the weight's
        rows are [gate; up] (SwiGLU's fused first matrix)."""
        return self._run(x, bias, True, threads)

    def _run(self, x, bias, gate, threads, residual=None):
        if not x.is_contiguous():
            x = x.contiguous()
        out = self.n // 2 if gate else self.n
        y = torch.empty(*x.shape[:-1], out, dtype=x.dtype)  # no reshape, no view: ~1.3 us each
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous()):
            residual = residual.to(x.dtype).contiguous()
        rc = load().tpk_linear(
            ctypes.c_void_p(x.data_ptr()), *self.args,
            ptr(bias), ptr(residual),
            ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(x.numel() // self.k), *self.sizes,
            INTS[DTYPES[x.dtype]], self.wdtype, INTS[gate],
            INTS[threads or torch.get_num_threads()])
        if rc != 0:
            raise RuntimeError(f"tpk_linear returned {rc}")
        return y


def norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float,
         offset: float = 0.0) -> torch.Tensor:
    """RMSNorm (`b` None) or LayerNorm of x [..., H] over its last dimension, scaled by
    (w + offset) (+ b): every sum float32, rounded once to x's dtype. x, w, b: one dtype
    of `DTYPES`' floats, on the CPU."""
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty_like(x)
    rc = load().tpk_norm(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(w.data_ptr()),
                         ptr(b),
                         ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(x.numel() // w.numel()),
                         ctypes.c_int64(w.numel()), ctypes.c_float(eps),
                         ctypes.c_float(offset), INTS[int(b is not None)],
                         INTS[DTYPES[x.dtype]])
    if rc != 0:
        raise RuntimeError(f"tpk_norm returned {rc}")
    return y


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a ctypes structure's field (None: null)."""
    return None if t is None else t.data_ptr()


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    """A tensor's data pointer as a ctypes argument (None: a null pointer)."""
    return NULL if t is None else ctypes.c_void_p(t.data_ptr())


def takes(heads: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether `rope_write` takes these rows of heads and this cache."""
    return (heads.device.type == "cpu" and heads.dtype in (torch.float32, torch.bfloat16)
            and cache.dtype == heads.dtype and cache.is_contiguous() and heads.stride(2) == 1
            and heads.stride(1) == heads.shape[2] and load() is not None)


def rope_write(heads: torch.Tensor, rotated: int, kv: int, cos: torch.Tensor | None,
               sin: torch.Tensor | None, write: torch.Tensor | None = None,
               cache_k: torch.Tensor | None = None, cache_v: torch.Tensor | None = None
               ) -> None:
    """In place: heads [T, nh, hd] (rows of contiguous heads, any row stride) get their
    first `rotated` heads rotated (Llama's rotate-half on the first cos.shape[-1] dims,
    torch's float32 roundings: `layers.rotary.apply_rope` bit for bit), then, `write`
    given, heads rotated - kv .. rotated (k) and rotated .. rotated + kv (v) copied into
    cache_k, cache_v [positions, kv, hd] at positions write [T]. cos, sin contiguous
    float32 [T, 1, rd] (None: nothing rotates). `takes` says which tensors it takes."""
    T, _, hd = heads.shape
    rotated_dims = 0 if cos is None else cos.shape[-1]  # cos, sin contiguous [T, ..., rd]
    rc = load().tpk_rope_write(
        ctypes.c_void_p(heads.data_ptr()), ctypes.c_int64(T), ctypes.c_int64(heads.stride(0)),
        INTS[rotated], INTS[kv], INTS[hd], ptr(cos), ptr(sin), INTS[rotated_dims], ptr(write),
        ptr(cache_k), ptr(cache_v), INTS[DTYPES[heads.dtype]])
    if rc != 0:
        raise RuntimeError(f"tpk_rope_write returned {rc}")


class Lin(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("wdtype", ctypes.c_int)]


class Layer(ctypes.Structure):
    """One layer of `run_layers` (decode_ops.cpp's `Layer`)."""
    _fields_ = [("n1w", ctypes.c_void_p), ("n1b", ctypes.c_void_p), ("n2w", ctypes.c_void_p),
                ("n2b", ctypes.c_void_p), ("n1eps", ctypes.c_float), ("n1off", ctypes.c_float),
                ("n2eps", ctypes.c_float), ("n2off", ctypes.c_float), ("qkv", Lin),
                ("out", Lin), ("fc1", Lin), ("fc2", Lin), ("act", ctypes.c_int),
                ("nq", ctypes.c_int), ("nkv", ctypes.c_int), ("hd", ctypes.c_int),
                ("kv_map", ctypes.c_void_p)]


class Ends(ctypes.Structure):
    """What a greedy decode adds around `run_layers` (decode_layers.h's `Ends`)."""
    _fields_ = [("table", ctypes.c_void_p), ("ptable", ctypes.c_void_p), ("ids", ctypes.c_void_p),
                ("pos", ctypes.c_void_p), ("vocab", ctypes.c_int64), ("vstart", ctypes.c_int64),
                ("vrows", ctypes.c_int64), ("nw", ctypes.c_void_p), ("nb", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("off", ctypes.c_float), ("head", Lin),
                ("valid", ctypes.c_int64), ("first", ctypes.c_int64), ("logits", ctypes.c_void_p),
                ("wide", ctypes.c_void_p), ("best", ctypes.c_void_p), ("gather", ctypes.c_void_p),
                ("tp", ctypes.c_int), ("every", ctypes.c_void_p), ("pick", ctypes.c_void_p),
                ("mask", ctypes.c_void_p), ("words", ctypes.c_int64)]


class Step(ctypes.Structure):
    """One forward of `run_layers` (decode_ops.cpp's `Step`)."""
    _fields_ = [("T", ctypes.c_int64), ("H", ctypes.c_int64), ("dtype", ctypes.c_int),
                ("threads", ctypes.c_int), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("rd", ctypes.c_int), ("pos", ctypes.c_void_p), ("write", ctypes.c_void_p),
                ("ck", ctypes.c_void_p), ("cv", ctypes.c_void_p), ("attend", ctypes.c_void_p), ("meta", ctypes.c_void_p),
                ("rows", ctypes.c_int), ("bs", ctypes.c_int), ("attend_threads", ctypes.c_int),
                ("reduce", ctypes.c_void_p), ("rbase", ctypes.c_void_p), ("rrank", ctypes.c_int),
                ("lead", ctypes.c_int), ("rsplit", ctypes.c_size_t), ("rtimeout", ctypes.c_double),
                ("who", ctypes.c_void_p), ("spans", ctypes.c_void_p), ("failed", ctypes.c_int),
                ("ends", ctypes.POINTER(Ends))]


REDUCE_FAILED = 1000  # tpk_layers: an all-reduce's failure code comes back as this + it


class ReduceFailed(RuntimeError):
    """`run_layers`' all-reduce number `at` (2 a layer: after the attention's output
    product, after the MLP's) returned the shared-memory code `code`."""

    def __init__(self, code: int, at: int) -> None:
        super().__init__(f"tpk_layers: all-reduce {at} returned {code}")
        self.code, self.at = code, at


ACTS = {"swiglu": 0, "gelu": 1, "gelu_exact": 2, "relu": 3}  # `Layer.act`




def lin(op: Operand, bias: torch.Tensor | None) -> Lin:
    """A product of `run_layers`: the operand's weight (and int8 scales) and a bias."""
    return Lin(op.w.data_ptr(), address(op.scale), address(bias), op.n, op.k, DTYPES[op.w.dtype])


def run_layers(x: torch.Tensor, layers, work: int, step: Step) -> torch.Tensor:
    """x [T, 1, H] through every layer of `layers` (a ctypes array of `Layer`) in one call;
    `work`: the bytes of scratch it needs (`tpk_layers`). A new tensor (or, with
    `step.ends` embedding the rows, x itself, written). At tp > 1 (`step.reduce` set) an
    all-reduce that fails raises `ReduceFailed`; -3: a token id outside the embedding."""
    if not (step.ends and step.ends.contents.table):
        x = x.contiguous().clone()
    scratch = torch.empty(work, dtype=torch.uint8)
    rc = load().tpk_layers(ctypes.c_void_p(x.data_ptr()), layers, ctypes.c_int(len(layers)),
                           ctypes.byref(step), ctypes.c_void_p(scratch.data_ptr()))
    if rc > REDUCE_FAILED:
        raise ReduceFailed(rc - REDUCE_FAILED, step.failed)
    if rc == -3:
        raise IndexError("a token id outside the embedding table")
    if rc != 0:
        raise RuntimeError(f"tpk_layers returned {rc}")
    return x


def shard_best(logits: torch.Tensor, first: int, vocab: int,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Each row of a vocabulary shard's logits [m, n] (the tokens first .., the padding
    past `vocab` left out) -> [m, 3] float32: its largest value, the token holding it
    first (torch's argmax: a NaN counts as the largest) and its log-sum-exp; a shard of
    padding alone gives -inf, -inf (none of its columns can win). Greedy decoding's token
    and log-probability (largest - log-sum-exp) in two passes over the row, where torch
    takes ~10 ops (~0.2 ms for 49152 columns here). Without the library: torch's ops.

    `allowed` (a grammar's mask): int32 [m, words], each row's bitmask over the whole
    vocabulary (bit t of word t // 32: token t may come): the largest value and its token
    are then those of the allowed columns (torch's argmax of the row with -inf where not
    allowed), the log-sum-exp still the whole shard's (the model's log-probability)."""
    x, n = logits.float(), columns(logits.shape[-1], first, vocab)
    if load() is None or x.device.type != "cpu" or x.stride(-1) != 1:
        top, idx = x[:, :n].max(-1)
        out = torch.stack([top, idx.float() + first, x[:, :n].logsumexp(-1)], -1)
        if first >= vocab:
            out[:, 0] = out[:, 2] = float("-inf")
        if allowed is not None:
            ok = unpacked(allowed, first, n)
            top, idx = x[:, :n].masked_fill(~ok, float("-inf")).max(-1)
            out[:, 0], out[:, 1] = top, idx.float() + first
        return out
    out = torch.empty(x.shape[0], 3)
    rc = load().tpk_best(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]),
                         ctypes.c_int64(n), ctypes.c_int64(x.stride(0)), ctypes.c_int64(first),
                         ctypes.c_int64(vocab), ctypes.c_void_p(out.data_ptr()))
    if rc == 0 and allowed is not None:
        allowed = allowed.contiguous()
        rc = load().tpk_allowed(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]),
                                ctypes.c_int64(n), ctypes.c_int64(x.stride(0)),
                                ctypes.c_int64(first), ctypes.c_void_p(allowed.data_ptr()),
                                ctypes.c_int64(allowed.shape[-1]),
                                ctypes.c_void_p(out.data_ptr()))
    if rc != 0:
        raise RuntimeError(f"tpk_best returned {rc}")
    return out


def unpacked(bits: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Bitmasks int32 [m, words] (token t: bit t % 32 of word t // 32) -> bool [m, n]:
    tokens first .. first + n (False past the bitmask)."""
    flat = bits.contiguous().view(torch.uint8)  # little-endian words: bytes in token order
    every = torch.from_numpy(np.unpackbits(flat.numpy(), axis=-1, bitorder="little"))
    out = torch.zeros(bits.shape[0], n, dtype=torch.bool)
    got = every[:, first:first + n].bool()
    out[:, :got.shape[1]] = got
    return out


def pick(every: torch.Tensor, tp: int) -> torch.Tensor:
    """Every rank's `shard_best` [tp * m, 3] (rank-major) -> [m, 2]: each row's greedy
    token (the first rank with the largest value: torch's argmax of the whole row) and
    its log-probability (value - the log-sum-exp over the ranks' log-sum-exps)."""
    m = every.shape[0] // tp
    if load() is None:
        every = every.view(tp, m, 3).transpose(0, 1)  # [m, tp, 3]
        vals = every[..., 0]
        win = (vals == vals.max(-1, keepdim=True).values).to(torch.int8).argmax(-1)
        top = every[torch.arange(m), win]  # [m, 3]
        return torch.stack([top[:, 1], top[:, 0] - every[..., 2].logsumexp(-1)], -1)
    every, out = every.float().contiguous(), torch.empty(m, 2)
    rc = load().tpk_pick(ctypes.c_void_p(every.data_ptr()), INTS[tp], ctypes.c_int64(m),
                         ctypes.c_void_p(out.data_ptr()))
    if rc != 0:
        raise RuntimeError(f"tpk_pick returned {rc}")
    return out


def columns(n: int, first: int, vocab: int) -> int:
    """The real tokens among a shard's n columns first .. (at least 1)."""
    return max(1, min(n, vocab - first))


def main() -> int:
    """Build the library; print where it is."""
    return LIBRARY.main("rows kernel", "decode products run on torch's matmuls")


if __name__ == "__main__":
    sys.exit(main())
