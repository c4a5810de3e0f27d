"""A decode-only model's decode rows on the native kernels alone (`kernels.decode_ops`).

    layer_plan(block)(x, cache)              # one pre-norm dense layer, its calls in a row
    stack = NativeStack.of(blocks, scopes)   # every layer in one native call
    x = stack(x, kv_caches)

What runs: the same kernels as `Block.forward` with decode-only weights would call one by
one (`attend.attend_paged`, `RowsWeight`, `NativeNorm`), without the
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
import time
import weakref
from collections.abc import Callable
from functools import partial

import torch

from tpkit.comm import collectives
from tpkit.comm.ops import reduce_from_tp
from tpkit.decode.attend import attend_paged
from tpkit.decode.forms import NativeNorm
from tpkit.kernels import decode_ops, paged_attention
from tpkit.layers.mlp import ParallelMLP
from tpkit.layers.rotary import rope_table

_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block -> NativeLayer | False


def layer_plan(block) -> NativeLayer | None:
    """A `Block`'s decode rows on `kernels.decode_ops` alone (`NativeLayer`), or None:
    a pre-norm dense layer whose norms and linear weights are all native decode-only
    ones (`decode.forms.for_decode` with the library), not training, no SP, no cp.
    Decided at the first decode (the weights do not change after `for_decode`; served
    adapters hooked in later: `forget`)."""
    plan = _PLANS.get(block)
    if plan is None:
        plan = _PLANS[block] = NativeLayer.of(block) or False
    return plan or None


def forget(block) -> None:
    """Decide `block`'s plan again at the next decode (its linears changed)."""
    _PLANS.pop(block, None)


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
        self.attend, self.hd, self.group = partial(attend_paged, at), at.head_dim, at.group
        self.rank0 = at.group.rank == 0  # the rank whose partial products carry the residual
        self.served = [m.served for m in (at.qkv, at.out, mlp.fc1, mlp.fc2)]  # adapters'
        self.adapters = next((s.adapters for s in self.served if s is not None), None)

    @classmethod
    def of(cls, b) -> NativeLayer | None:
        at, mlp = b.attn, b.mlp
        if not (b.pre_norm and not b.parallel_residual and not b.training
                and not b.sequence_parallel and isinstance(mlp, ParallelMLP)
                and isinstance(b.attn_norm, NativeNorm) and isinstance(b.mlp_norm, NativeNorm)
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

    def _row(self, op: decode_ops.Operand, x: torch.Tensor, bias, residual: torch.Tensor,
             served=None) -> torch.Tensor:
        """residual + x W^T + bias of a row-parallel product: at tp=1 one call; at tp > 1
        rank 0's partial product takes the residual and the bias in its call (the others'
        nothing), then the all-reduce sums them: (residual + bias + p0) + p1 + ...
        `served`: served adapters' deltas added to each rank's partial (`serve.adapters`)."""
        p = op(x, bias, residual) if self.rank0 else op(x)
        return reduce_from_tp(p if served is None else served(x, p), self.group)

    def __call__(self, x: torch.Tensor, cache) -> torch.Tensor:
        if self.adapters is not None and self.adapters.rows is not None:
            return self._adapted(x, cache)
        T = x.shape[0]
        h = decode_ops.norm(x, *self.norms[0])
        y = self.attend(self.qkv(h, self.qkv_bias).view(T, -1, self.hd), cache)  # [T, nq, hd]
        x = self._row(self.out, y.view(T, 1, -1), self.out_bias, x)
        h = decode_ops.norm(x, *self.norms[1])
        a = self.fc1.gated(h, self.fc1_bias) if self.gated else self.act(self.fc1(h, self.fc1_bias))
        return self._row(self.fc2, a, self.fc2_bias, x)

    def _adapted(self, x: torch.Tensor, cache) -> torch.Tensor:
        """`__call__` with served adapters on some rows (`serve.adapters`): the same calls,
        each adapted row's delta added to its products (its fused SwiGLU again unfused)."""
        T, (q, o, f1, f2) = x.shape[0], self.served
        h = decode_ops.norm(x, *self.norms[0])
        y = self.qkv(h, self.qkv_bias)
        y = self.attend((y if q is None else q(h, y)).view(T, -1, self.hd), cache)
        x = self._row(self.out, y.view(T, 1, -1), self.out_bias, x, o)
        h = decode_ops.norm(x, *self.norms[1])
        if self.gated:
            a = self.fc1.gated(h, self.fc1_bias)
            a = a if f1 is None else f1.gated(h, a, lambda t: self.fc1(t, self.fc1_bias),
                                              self.act)
        else:
            y = self.fc1(h, self.fc1_bias)
            a = self.act(y if f1 is None else f1(h, y))
        return self._row(self.fc2, a, self.fc2_bias, x, f2)


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
        self.row_work = max(b.attn.hidden + p.qkv.n + b.attn.local_heads * p.hd + p.fc1.n
                            for p, b in zip(plans, blocks))  # elements a row needs
        self.hidden, self.dtype = at.hidden, plans[0].norms[0][0].dtype  # the activations'
        self.attend = ctypes.cast(paged_attention.load().tpk_paged_attention,
                                  ctypes.c_void_p).value
        self.group = at.group
        self.reduce = collectives.native_all_reduce(self.group)  # tp=1: None
        self.scopes = [s for s in scopes for _ in range(2)]  # each all-reduce's scope
        self.spans = (ctypes.c_double * (2 * len(self.scopes) + 4))()  # + the ends' two
        self._table = (0,)  # (rope_len, cos, sin): the rotary table the call reads
        self._cached = (None,)  # (the first k cache, the caches' pointer arrays)

    @classmethod
    def of(cls, blocks: list, scopes: list[str]) -> NativeStack | None:
        plans = [layer_plan(b) for b in blocks]
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

    def takes(self, rows: int, dtype: torch.dtype, caches: list) -> bool:
        """Whether this forward's rows (`rows` of `dtype`) are all decode rows the kernels
        take."""
        batch, k = caches[0].batch, caches[0].k
        return (batch.decode is not None and not batch.adapted and batch.decode.rows == rows
                and rows <= decode_ops.ROWS and dtype in (torch.float32, torch.bfloat16)
                and k.dtype == dtype and k.is_contiguous() and k.device.type == "cpu")

    def __call__(self, x: torch.Tensor, caches: list, ends: NativeEnds | None = None
                 ) -> torch.Tensor:
        """x [T, 1, H] through the layers; with `ends` (x: the ids [T, 1] where the ends
        embed them) each row's greedy token and log-probability [T, 2] instead."""
        return self.ready(x, caches, ends)()

    def ready(self, x: torch.Tensor, caches: list, ends: NativeEnds | None = None
              ) -> Callable[[], torch.Tensor]:
        """`self(x, caches, ends)` up to the native call: the function that makes it (a
        follower readies the step it expects while rank 0 plans it: `serve.runner`). Until
        it runs, the stack and `ends` are not called again."""
        batch = caches[0].batch
        T, plan = x.shape[0], batch.decode
        if self.how is not None and batch.rope_len != self._table[0]:
            self._table = (batch.rope_len, *rope_table(*self.how[:2], batch.rope_len, None,
                                                       self.how[2]))
        cos, sin = (None, None) if self.how is None else self._table[1:]
        step = decode_ops.Step(
            T, self.hidden, decode_ops.DTYPES[self.dtype], torch.get_num_threads(),
            decode_ops.address(cos), decode_ops.address(sin),
            0 if cos is None else cos.shape[-1], batch.positions.data_ptr(),
            batch.write.data_ptr(), *self._pointers(caches), self.attend, plan.meta.data_ptr(),
            plan.rows, plan.args[2].value, plan.args[3].value)
        work = T * self.row_work * self.dtype.itemsize + 64 + (
            0 if cos is None else 2 * T * cos.shape[-1] * 4)
        if ends is not None:
            step.ends = ctypes.pointer(ends.point(x, batch.positions, self.dtype))
            if ends.embeds:
                x = torch.empty(T, 1, self.hidden, dtype=self.dtype)
        if self.reduce is not None:
            fn, base, rank, split, timeout, who = self.reduce
            step.reduce, step.rbase, step.rrank, step.lead = fn, base, rank, int(rank == 0)
            step.rsplit, step.rtimeout, step.who = split, timeout, who
            step.spans = ctypes.addressof(self.spans)
        return partial(self._go, x, work, step, ends, None if ends is None else ends.pick,
                       caches)  # the step points into the caches' batch: kept alive

    def _go(self, x: torch.Tensor, work: int, step: decode_ops.Step, ends: NativeEnds | None,
            pick: torch.Tensor | None, _caches, allowed: torch.Tensor | None = None
            ) -> torch.Tensor:
        """The native call `ready` prepared; at tp > 1 its collectives into the ledger.
        `allowed`: the rows' grammar bitmasks for the ends' best (`NativeEnds.allow`)."""
        if ends is not None:
            ends.allow(allowed)
        if self.reduce is None:
            x = decode_ops.run_layers(x, self.layers, work, step)
            return x if ends is None else pick
        began = time.perf_counter()
        try:
            x = decode_ops.run_layers(x, self.layers, work, step)
        except decode_ops.ReduceFailed as e:  # the call's collectives, by number: the
            ops = [("all_reduce", x, scope) for scope in self.scopes]  # layers', then
            if ends is not None:  # the embedding's all-reduce and the all-gather of the best
                ops += [("all_reduce", x, "embed"), ("all_gather", ends.every, None)]
            op, t, scope = ops[e.at]
            collectives.native_failed(self.group, op, e.code, t, scope, began=began)
        s, n = self.spans[:], len(self.scopes)  # numbered as above: the layers' all-
        spans, scopes = list(zip(s[0:2 * n:2], s[1:2 * n:2])), self.scopes  # reduces, the
        if ends is not None and ends.embeds:  # embedding's, the all-gather (one call each)
            spans, scopes = spans + [(s[2 * n], s[2 * n + 1])], scopes + ["embed"]
        collectives.record_native(self.group, "all_reduce", x, spans, scopes)
        if ends is not None:
            collectives.record_native(self.group, "all_gather", ends.every,
                                      [(s[2 * n + 2], s[2 * n + 3])], [None])
        return x if ends is None else pick

    def _pointers(self, caches: list) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        """The layers' k and v caches' pointers (made again only when the cache grew)."""
        key = caches[0].k
        if self._cached[0] is not key:
            n = len(caches)
            k = (ctypes.c_void_p * n)(*(c.k.data_ptr() for c in caches))
            v = (ctypes.c_void_p * n)(*(c.v.data_ptr() for c in caches))
            self._cached = (key, k, v, ctypes.cast(k, ctypes.c_void_p),
                            ctypes.cast(v, ctypes.c_void_p))
        return self._cached[3], self._cached[4]


class NativeEnds:
    """What a greedy decode adds around `NativeStack` in the same native call: the
    embedding lookup (a plain word table, vocab-parallel: its all-reduce at tp > 1, and a
    learned position table or none), then after the layers the final norm, the head's
    product and the best of this rank's vocabulary shard (`decode_ops.shard_best`),
    gathered from every rank at tp > 1 and picked (`decode_ops.pick`): decode rows' ids
    in, their greedy tokens and log-probabilities [T, 2] out, the modules and ~30 torch
    ops between them gone. `NativeEnds.of(model)`: None where the model's ends are not
    those (the modules run); the embedding stays in Python where it is not a plain table."""

    def __init__(self, model, embeds: bool) -> None:
        fn, rows, e, g = model.final_norm, model.head_decoding.rows, model.embed, model.group
        self.embeds, self.n = embeds, rows.n
        first = g.rank * rows.n  # this shard's first token id
        self.struct = decode_ops.Ends(
            e.word.weight.data_ptr() if embeds else None,
            decode_ops.address(e.position.weight if embeds and e.position is not None
                               else None), None, None, model.config.vocab_size,
            e.word.vocab_start, e.word.per_rank,
            decode_ops.address(fn.weight if fn is not None else None),
            decode_ops.address(fn.bias if fn is not None else None),
            fn.eps if fn is not None else 0.0, fn.offset if fn is not None else 0.0,
            decode_ops.lin(rows, None), decode_ops.columns(rows.n, first, model.config.vocab_size),
            first, None, None, None, collectives.native_all_gather(g), g.size)

    @classmethod
    def of(cls, model) -> NativeEnds | None:
        rows = getattr(model.head_decoding, "rows", None)
        fn, g = model.final_norm, model.group
        if rows is None or not (model.is_first_stage and model.is_last_stage) or (
                fn is not None and not isinstance(fn, NativeNorm)) or (
                g.size > 1 and collectives.native_all_gather(g) is None):
            return None
        e = model.embed
        w = e.word.weight
        embeds = (e.scale == 1.0 and e.token_type is None and e.norm is None and not e.sp
                  and e.cp is None and w.is_contiguous() and w.device.type == "cpu"
                  and w.dtype in (torch.float32, torch.bfloat16)
                  and (e.position is None or (e.position.weight.dtype == w.dtype
                                              and e.position.weight.is_contiguous())))
        return cls(model, embeds)

    def allow(self, bits: torch.Tensor | None) -> None:
        """The next call's grammar bitmasks, int32 [T, words] over the whole vocabulary
        (`decode_ops.shard_best`'s `allowed`), or None: no mask."""
        self.bits = None if bits is None else bits.contiguous()
        self.struct.mask = decode_ops.address(self.bits)
        self.struct.words = 0 if bits is None else bits.shape[-1]

    def point(self, x: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
              ) -> decode_ops.Ends:
        """The struct pointed at this call's tensors (x: the ids [T, 1] where it embeds):
        `pick` [T, 2] is what the call fills."""
        T, s = x.shape[0], self.struct
        if self.embeds:
            ids = x.reshape(-1)
            self.ids = ids if ids.is_contiguous() else ids.contiguous()
            s.ids, s.pos = self.ids.data_ptr(), positions.data_ptr()
        self.logits = torch.empty(T, self.n, dtype=dtype)
        self.wide = torch.empty(T, self.n) if dtype != torch.float32 else None
        self.best, self.pick = torch.empty(T, 3), torch.empty(T, 2)
        self.every = torch.empty(s.tp * T, 3) if s.tp > 1 else None
        s.logits, s.best, s.pick = (self.logits.data_ptr(), self.best.data_ptr(),
                                    self.pick.data_ptr())
        s.wide, s.every = decode_ops.address(self.wide), decode_ops.address(self.every)
        return s
