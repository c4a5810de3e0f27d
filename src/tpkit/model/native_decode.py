"""A decode-only model's decode rows on the native kernels alone (`layers.decode_ops`).

    NativeLayer.of(block)(x, cache)          # one pre-norm dense layer, its calls in a row
    stack = NativeStack.of(blocks, scopes)   # every layer in one native call
    x = stack(x, kv_caches)

What runs: the same kernels as `Block.forward` with decode-only weights would call one by
one (`ParallelAttention._attend_paged`, `RowsWeight`, the native norms), without the
modules between them: a module attribute costs ~1 us and a module call ~3, ~15 a layer,
and at one row a 30-layer model's token is ~12 ms of weights and was ~5 ms of this.
`NativeStack` runs every layer in one call (`tpk_layers`: the attention kernel called
from C, at tp > 1 the shared-memory all-reduce too) for a forward whose rows are all
decode rows (one token each, at most `decode_ops.ROWS`); otherwise (a short piece of a
prompt among the rows, or tp > 1 without a shared-memory channel) `NativeLayer` runs
each layer's calls from Python, the all-reduces between them, for a forward of at most
`decode_ops.ROWS` rows. Either only on layers it takes: pre-norm, dense, native norms
and decode-only weights, no SP or cp (the stack: no qk-norm, no GeGLU either).
"""

from __future__ import annotations

import ctypes

import torch

from tpkit.comm import collectives
from tpkit.comm.ops import reduce_from_tp
from tpkit.layers import decode_ops, paged_attention
from tpkit.layers.attention import PagedKV, paged_angles
from tpkit.layers.mlp import ParallelMLP


class NativeLayer:
    """A decode-only pre-norm dense layer's decode rows x [T, 1, h] (T <= decode_ops.ROWS)
    on the native kernels alone, the modules' tensors and kernels looked up once (a
    module attribute costs ~1 us, a module call ~3: ~15 a layer, 30 layers a token):

        h = norm(x); x = x + out(attention(qkv(h))); h = norm(x); x = x + fc2(act(fc1(h)))

    at tp=1 each residual and bias added inside the product's call (`Block.forward`'s
    sums in its order); at tp > 1 inside rank 0's partial product, before the all-reduce
    (`_row`: no op after it)."""

    def __init__(self, b) -> None:
        at, mlp = b.attn, b.mlp
        self.norms = [(n.weight, n.bias, n.eps, n.offset) for n in (b.attn_norm, b.mlp_norm)]
        self.qkv, self.qkv_bias = at.qkv.decoding.rows, at.qkv.bias
        self.out, self.out_bias = at.out.decoding.rows, at.out.bias
        self.fc1, self.fc1_bias = mlp.fc1.decoding.rows, mlp.fc1.bias
        self.fc2, self.fc2_bias = mlp.fc2.decoding.rows, mlp.fc2.bias
        self.gated, self.act = mlp.activation == "swiglu", mlp.act
        self.attend, self.hd, self.group = at._attend_paged, at.head_dim, at.group
        self.rank0 = at.group.rank == 0  # the rank whose partial products carry the residual

    @classmethod
    def of(cls, b) -> NativeLayer | None:
        at, mlp = b.attn, b.mlp
        if not (b.pre_norm and not b.parallel_residual and not b.training
                and not b.sequence_parallel and isinstance(mlp, ParallelMLP)
                and b.attn_norm.native and b.mlp_norm.native
                and (at.cp is None or at.cp.size == 1)):
            return None
        if any(getattr(m.decoding, "rows", None) is None
               for m in (at.qkv, at.out, mlp.fc1, mlp.fc2)):
            return None
        return cls(b)

    def struct(self, b) -> decode_ops.Layer:
        """This layer as `decode_ops.Layer` (`NativeStack`)."""
        at = b.attn
        (w1, b1, e1, o1), (w2, b2, e2, o2) = self.norms
        kv = self.kv = paged_attention.kv_map(at.local_heads, at.local_kv, at._kv_key)  # kept:
        return decode_ops.Layer(  # the struct holds its pointer (kv_map's cache may drop it)
            w1.data_ptr(), decode_ops.address(b1), w2.data_ptr(), decode_ops.address(b2),
            e1, o1, e2, o2,
            decode_ops.lin(self.qkv, self.qkv_bias), decode_ops.lin(self.out, self.out_bias),
            decode_ops.lin(self.fc1, self.fc1_bias), decode_ops.lin(self.fc2, self.fc2_bias),
            decode_ops.ACTS[b.mlp.activation], at.local_heads, at.local_kv, at.head_dim,
            kv[1].value)

    def _row(self, op: decode_ops.Operand, x: torch.Tensor, bias, residual: torch.Tensor
             ) -> torch.Tensor:
        """residual + x W^T + bias of a row-parallel product: at tp=1 one call; at tp > 1
        rank 0's partial product takes the residual and the bias in its call (the others'
        nothing), then the all-reduce sums them: (residual + bias + p0) + p1 + ..."""
        if self.rank0:
            return reduce_from_tp(op(x, bias, residual), self.group)
        return reduce_from_tp(op(x), self.group)

    def __call__(self, x: torch.Tensor, cache: PagedKV) -> torch.Tensor:
        T = x.shape[0]
        h = decode_ops.norm(x, *self.norms[0])
        y = self.attend(self.qkv(h, self.qkv_bias).view(T, -1, self.hd), cache)  # [T, nq, hd]
        x = self._row(self.out, y.view(T, 1, -1), self.out_bias, x)
        h = decode_ops.norm(x, *self.norms[1])
        a = self.fc1.gated(h, self.fc1_bias) if self.gated else self.act(self.fc1(h, self.fc1_bias))
        return self._row(self.fc2, a, self.fc2_bias, x)


class NativeStack:
    """Every layer of a decode-only model in one native call per forward
    (`decode_ops.run_layers`): `NativeStack.of(layers, scopes)` or None where it cannot
    run. At tp > 1 the all-reduces run inside that call too, on the group's shared-memory
    channel (none: None), and go into the ledger afterwards, each in its layer's scope."""

    def __init__(self, plans: list[NativeLayer], blocks: list, scopes: list[str]) -> None:
        at = blocks[0].attn
        self.how = (at.rope_dim, at.rope_theta, at.rope_llama3) if at.rope_theta else None
        self.layers = (decode_ops.Layer * len(plans))(*(p.struct(b) for p, b in
                                                        zip(plans, blocks)))
        self.work = max(b.attn.hidden + p.qkv.n + b.attn.local_heads * p.hd + p.fc1.n
                        for p, b in zip(plans, blocks))
        self.hidden = at.hidden
        self.attend = ctypes.cast(paged_attention.load().tpk_paged_attention,
                                  ctypes.c_void_p).value
        self.group = at.group
        self.reduce = collectives.native_all_reduce(self.group)  # tp=1: None
        self.scopes = [s for s in scopes for _ in range(2)]  # each all-reduce's scope
        self.spans = (ctypes.c_double * (2 * len(self.scopes)))()

    @classmethod
    def of(cls, blocks: list, scopes: list[str]) -> NativeStack | None:
        plans = [b.native_decode() for b in blocks]
        if not plans or any(p is None or p.group is not plans[0].group for p in plans):
            return None
        if paged_attention.load() is None or (plans[0].group.size > 1 and
                                              collectives.native_all_reduce(plans[0].group)
                                              is None):
            return None
        hows = {(b.attn.rope_dim, b.attn.rope_theta, b.attn.rope_llama3) for b in blocks}
        if len(hows) != 1 or any(b.attn.q_norm is not None or b.mlp.activation not in
                                 decode_ops.ACTS for b in blocks):
            return None
        return cls(plans, blocks, scopes)

    def takes(self, x: torch.Tensor, caches: list[PagedKV]) -> bool:
        """Whether this forward's rows are all decode rows the kernels take."""
        batch, k = caches[0].batch, caches[0].k
        return (batch.decode is not None and batch.decode.rows == x.shape[0]
                and decode_ops.fits(x) and k.dtype == x.dtype and k.is_contiguous())

    def __call__(self, x: torch.Tensor, caches: list[PagedKV]) -> torch.Tensor:
        batch = caches[0].batch
        cos = sin = None
        if self.how is not None:
            cos, sin = paged_angles(batch, self.how, x.shape[0])
        n = len(caches)
        plan = batch.decode
        step = decode_ops.Step(
            x.shape[0], self.hidden, decode_ops.DTYPES[x.dtype], torch.get_num_threads(),
            decode_ops.address(cos), decode_ops.address(sin),
            0 if cos is None else cos.shape[-1], batch.write.data_ptr(),
            ctypes.cast((ctypes.c_void_p * n)(*(c.k.data_ptr() for c in caches)),
                        ctypes.c_void_p),
            ctypes.cast((ctypes.c_void_p * n)(*(c.v.data_ptr() for c in caches)),
                        ctypes.c_void_p),
            self.attend, plan.meta.data_ptr(), plan.rows, plan.args[2].value,
            plan.args[3].value)
        if self.reduce is None:
            return decode_ops.run_layers(x, self.layers, self.work, step)
        fn, base, rank, split, timeout, who = self.reduce
        step.reduce, step.rbase, step.rrank, step.lead = fn, base, rank, int(rank == 0)
        step.rsplit, step.rtimeout, step.who = split, timeout, who
        step.spans = ctypes.addressof(self.spans)
        try:
            x = decode_ops.run_layers(x, self.layers, self.work, step)
        except decode_ops.ReduceFailed as e:
            collectives.native_failed(self.group, "all_reduce", e.code, x, self.scopes[e.at])
        s = self.spans
        collectives.record_native(self.group, "all_reduce", x,
                                  [(s[i], s[i + 1]) for i in range(0, len(s), 2)], self.scopes)
        return x
