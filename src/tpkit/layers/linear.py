"""Column- and row-parallel linear layers (Shoeybi et al. 2019, section 3, figure 3).

    Y = X A, A split by columns          Z = Y B, B split by rows
    A = [A_0 | A_1]                      B = [B_0 ; B_1]
    rank r: Y_r = X A_r   ([b, s, n/tp]) rank r: Z_r = Y_r B_r   ([b, s, m], partial)
                                         Z = Z_0 + Z_1           (one all-reduce)

A column-parallel layer needs the full X on every rank (f = copy_to_tp: identity
forward, all-reduce of dX backward) and leaves its output split by columns. A
row-parallel layer takes that split input as is and sums the partial products
(g = reduce_from_tp). Column then row: nothing is sent in between.

Weights are stored as torch does, [out, in]: "split by columns of A" is dim 0 of
the stored weight, "split by rows of B" is dim 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.comm import collectives as C
from tpkit.comm import ops, parts
from tpkit.comm.group import CommGroup
from tpkit.layers.sharding import TPSplit, master_normal, set_meta, shard


class _ColumnLinear(torch.autograd.Function):
    """f (or SP's all-gather) fused with the matmul, so that backward overlaps the
    input-gradient collective with the weight-gradient matmul (as Megatron-LM does):

        forward:  x_full = x (or all-gather of the sequence);  y = x_full A^T + b
        backward: dx = dy A   -> start all-reduce (or reduce-scatter) of dx
                  dA = dy^T x_full, db = sum dy          <- while dx is on the wire
                  wait for dx
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sp):
        ctx.sizes = ops.sp_sizes(group, x.shape[ops.SEQ_DIM]) if sp else None  # SP parts
        x_full = parts.all_gather_parts(x, group, ctx.sizes, ops.SEQ_DIM) if sp else x
        ctx.dtypes = (x.dtype, weight.dtype)
        if torch.is_autocast_enabled(x.device.type):  # cast once, save the cast copies
            dt = torch.get_autocast_dtype(x.device.type)
            x_full, weight = x_full.to(dt), weight.to(dt)
            bias = bias.to(dt) if bias is not None else None
        ctx.save_for_backward(x_full, weight)
        ctx.group, ctx.sp, ctx.has_bias = group, sp, bias is not None
        ctx.scope = group.ledger.current_scope()
        return F.linear(x_full, weight, bias)  # [b, s, out/tp]

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.to(w.dtype)
        dx = dy.matmul(w)  # [b, s, in], this rank's partial sum
        if ctx.sp:
            pending = parts.reduce_scatter_parts_async(dx, ctx.group, ctx.sizes, ops.SEQ_DIM,
                                                       scope=ctx.scope)
        else:
            pending = C.all_reduce_async(dx, ctx.group, scope=ctx.scope)
        dy2 = dy.reshape(-1, dy.shape[-1])  # [b*s, out/tp]
        dw = db = None  # a frozen weight (LoRA's base): not computed
        if ctx.needs_input_grad[1]:
            dw = dy2.t().matmul(x.reshape(-1, x.shape[-1])).to(ctx.dtypes[1])  # [out/tp, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return pending.wait().to(ctx.dtypes[0]), dw, db, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: CommGroup, sequence_parallel: bool = False) -> torch.Tensor:
    """x [b, s, in] ([b, s/tp, in] with SP) times this rank's rows of A: [b, s, out/tp].

    f (or SP's all-gather) fused with the matmul; backward all-reduces (or
    reduce-scatters) dx behind the dW matmul. At tp=1, and without SP where no gradient
    is taken (a decode: f is the identity forward), it is a plain `F.linear`: an
    autograd Function's call costs several times a small matmul's dispatch.
    """
    if group.size == 1 or not (sequence_parallel or torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    return _ColumnLinear.apply(x, weight, bias, group, sequence_parallel)


def _local(layer: nn.Module) -> torch.Size:
    """The shape of this rank's weight [out, in] (float, or its decoding form)."""
    return layer.weight.shape if layer.decoding is None else layer.decoding.shape


def _reset_sharded(layer: nn.Module) -> None:
    """The tp=1 weight [out, in] drawn from the layer's seed; this rank keeps its slice."""
    if layer.weight.is_meta:
        return
    full = master_normal((layer.out_features, layer.in_features), layer.init_std, layer.seed)
    with torch.no_grad():
        layer.weight.copy_(shard(full, layer.split, layer.group.rank, layer.group.size))
        if layer.bias is not None:
            layer.bias.zero_()


def _even(split: TPSplit, tp: int, what: str) -> None:
    """ValueError unless every rank holds as many rows (an all-gather or a scatter of
    the split dimension needs equal parts)."""
    if not split.even_over(tp):
        raise ValueError(f"{what} needs the split sizes {list(split.parts)} to divide by "
                         f"tp={tp}")


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output features split over tp, as evenly as possible (the
    first ranks one more when tp does not divide them).

    `partition_sizes` declares fused weights (e.g. [ffn, ffn] for gate+up, or
    [q, k, v]): each logical part is split separately, so every rank holds its slice
    of each. `split` gives the whole layout instead (heads as units, grouped-query kv
    heads shared by the ranks that read them: `TPSplit.heads`).
    """

    def __init__(self, in_features: int, out_features: int, group: CommGroup, *,
                 bias: bool = True, gather_output: bool = False,
                 partition_sizes: list[int] | None = None, split: TPSplit | None = None,
                 sequence_parallel: bool = False, init_std: float = 0.02, seed: int = 0,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        tp = group.size
        self.split = split or TPSplit(0, tuple(partition_sizes or [out_features]))
        if sum(self.split.parts) != out_features:
            raise ValueError(f"partition_sizes {list(self.split.parts)} sum to "
                             f"{sum(self.split.parts)}, not out_features={out_features}")
        self.split.check(tp, "ColumnParallelLinear")
        if sequence_parallel and gather_output:
            raise ValueError("sequence_parallel and gather_output cannot both be set")
        if gather_output:
            _even(self.split, tp, "gather_output")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.init_std, self.seed = init_std, seed
        local = self.split.local_size(group.rank, tp)
        kw = dict(device=device, dtype=dtype)
        self.weight = set_meta(nn.Parameter(torch.empty(local, in_features, **kw)),
                               split=self.split)
        self.bias = set_meta(nn.Parameter(torch.empty(local, **kw)),
                             split=self.split) if bias else None
        self.decoding = None  # the weight in a decode-only form (`decode.forms.for_decode`)
        self.lora = None  # its low-rank adapters (`layers.lora.LoRA`), or None
        self.served = None  # served adapters per row (`serve.adapters.Served`), or None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the full weight from `seed` and keep this rank's slice; zero bias."""
        _reset_sharded(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, in] (or [b, s/tp, in] with sequence parallelism) -> [b, s, out/tp]."""
        if self.decoding is not None:  # a decode (f is the identity forward)
            y = self.decoding(x, self.bias)
        elif self.lora is not None:  # W x + s B A x, in the base's one collective
            y = self.lora.column(x, self)
        else:
            y = column_parallel_linear(x, self.weight, self.bias, self.group,
                                       self.sequence_parallel)  # [b, s, out/tp]
        if self.served is not None:  # the adapted rows' deltas (a served decode)
            y = self.served(x, y)
        return ops.gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {_local(self)[0]}), "
                f"tp={self.group.size}, gather_output={self.gather_output}, "
                f"sp={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input features split over tp (as evenly as possible, in
    `units` of in_features / units: the heads of attention's output projection);
    partial outputs all-reduced.

    The bias is added once, after the reduce. `partial(x)` returns this rank's
    un-reduced contribution (quiz answer 7: the partials sum to the full output).
    """

    def __init__(self, in_features: int, out_features: int, group: CommGroup, *,
                 bias: bool = True, input_is_parallel: bool = True, units: int | None = None,
                 sequence_parallel: bool = False, init_std: float = 0.02, seed: int = 0,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        tp = group.size
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.init_std, self.seed = init_std, seed
        self.split = TPSplit.even(1, in_features, units)  # units: heads (attention's out)
        self.split.check(tp, "RowParallelLinear")
        if not input_is_parallel:
            _even(self.split, tp, "input_is_parallel=False")
        local = self.split.local_size(group.rank, tp)
        kw = dict(device=device, dtype=dtype)
        self.weight = set_meta(nn.Parameter(torch.empty(out_features, local, **kw)),
                               split=self.split)
        # with SP the bias is added on [b, s/tp, h]: its grad is partial per tp rank
        self.bias = set_meta(nn.Parameter(torch.empty(out_features, **kw)),
                             sequence_parallel=sequence_parallel) if bias else None
        self.decoding = None  # the weight in a decode-only form (`decode.forms.for_decode`)
        self.lora = None  # its low-rank adapters (`layers.lora.LoRA`), or None
        self.served = None  # served adapters per row (`serve.adapters.Served`), or None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the full weight from `seed` and keep this rank's slice; zero bias."""
        _reset_sharded(self)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product x_r A_r^T [b, s, out] (no reduce, no bias)."""
        if not self.input_is_parallel:
            x = ops.scatter_to_tp(x, self.group)  # [b, s, in/tp]
        if self.decoding is not None:  # decode-only weights (`decode.forms`)
            y = self.decoding(x)  # [b, s, out], a partial sum
        else:
            y = F.linear(x, self.weight)  # [b, s, out], a partial sum
            y = y if self.lora is None else y + self.lora.row_delta(x)  # summed alike
        return y if self.served is None else self.served(x, y)  # served adapters' too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, in/tp] (or [b, s, in] if not input_is_parallel) -> [b, s, out]."""
        y = self.partial(x)  # [b, s, out], partial over tp
        if self.sequence_parallel:
            y = ops.reduce_scatter_to_sp(y, self.group)  # [b, s/tp, out]
        else:
            y = ops.reduce_from_tp(y, self.group)  # [b, s, out]
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {_local(self)[1]}), out={self.out_features}, "
                f"tp={self.group.size}, input_is_parallel={self.input_is_parallel}, "
                f"sp={self.sequence_parallel}")
