"""LoRA (Hu et al. 2021) on the tensor-parallel linear layers: W frozen, and

    y = W x + (alpha / r) B A x        A [r, in], B [out, r] (PEFT's lora_A, lora_B)

with A and B split to match W, so that the adapter sends nothing per micro-batch that
the base layer does not already send:

    column-parallel W (its output rows split; a fused qkv or gate+up: each part alone):
        B split by output rows as W's part is, A replicated
        forward   x is whole on every rank already (f):  y_r += s B_r (A x)
        backward  dx_r = dy_r W_r + s (dy_r B_r) A: in the base's all-reduce of dx
    row-parallel W (its input columns split):
        A split by input columns as W is, B replicated
        forward   y_r += s B (A_r x_r): in the base's all-reduce of the partial y_r
        backward  dy is whole on every rank: dx_r and dA_r are local

Where it is not possible: the replicated factor's gradient. Column A's (dA = s (dy
B)^T x needs every row of B) and row B's (dB = s dy^T (sum_r A_r x_r)) are partial
sums over tp. They are tagged partial (`ParamMeta.sequence_parallel`, as the SP
norms) and summed by `finalize_tp_grads` in its one flat all-reduce of partial
gradients: once per step, not per layer or micro-batch (with sequence parallelism or
q/k norms, the all-reduce the base model sends anyway).

A gets Kaiming-uniform values from the seed (PEFT's init), B zeros: an adapted model
starts as its base. The full A is drawn on every rank, so every tp holds the same.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.comm import collectives as C
from tpkit.comm import ops, parts
from tpkit.layers.sharding import TPSplit, meta_of, seed_for, set_meta, shard
from tpkit.spec.config import ModelConfig


class _ColumnLoRA(torch.autograd.Function):
    """A column-parallel layer with its adapter, one collective as `_ColumnLinear`:

        forward:  x_full = x (or SP's all-gather); u = x_full a^T; y = x_full W^T + b + s u b^T
        backward: du = s dy b (partial);  dx = dy W + du a  -> all-reduce (or reduce-scatter)
                  db = s dy^T u;  da = du^T x_full (partial: `finalize_tp_grads` sums it)
    """

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scale, group, sp):
        ctx.sizes = ops.sp_sizes(group, x.shape[ops.SEQ_DIM]) if sp else None
        x_full = parts.all_gather_parts(x, group, ctx.sizes, ops.SEQ_DIM) if sp else x
        ctx.dtypes = (x.dtype, weight.dtype, a.dtype)
        if torch.is_autocast_enabled(x.device.type):  # cast once, save the cast copies
            dt = torch.get_autocast_dtype(x.device.type)
            x_full, weight, a, b = (t.to(dt) for t in (x_full, weight, a, b))
            bias = bias.to(dt) if bias is not None else None
        u = F.linear(x_full, a)  # [b, s, R]
        ctx.save_for_backward(x_full, weight, a, b, u)
        ctx.group, ctx.sp, ctx.scale = group, sp, scale
        ctx.scope = group.ledger.current_scope()
        return F.linear(x_full, weight, bias) + scale * F.linear(u, b)  # [b, s, out/tp]

    @staticmethod
    def backward(ctx, dy):
        x, w, a, b, u = ctx.saved_tensors
        dy = dy.to(w.dtype)
        dv = dy * ctx.scale
        du = dv.matmul(b)  # [b, s, R], this rank's partial sum
        dx = dy.matmul(w) + du.matmul(a)  # [b, s, in], this rank's partial sum
        if ctx.sp:
            pending = parts.reduce_scatter_parts_async(dx, ctx.group, ctx.sizes, ops.SEQ_DIM,
                                                       scope=ctx.scope)
        else:
            pending = C.all_reduce_async(dx, ctx.group, scope=ctx.scope)
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        needs = ctx.needs_input_grad
        dw = dy2.t().matmul(x2) if needs[1] else None  # a frozen base: not computed
        dbias = dy2.sum(0) if needs[2] else None
        da = du.reshape(-1, du.shape[-1]).t().matmul(x2)  # [R, in]
        db = dv.reshape(-1, dv.shape[-1]).t().matmul(u.reshape(-1, u.shape[-1]))  # [out/tp, R]
        x_dtype, w_dtype, a_dtype = ctx.dtypes
        return (pending.wait().to(x_dtype), dw if dw is None else dw.to(w_dtype), dbias,
                da.to(a_dtype), db.to(a_dtype), None, None, None)


class LoRA(nn.Module):
    """The adapters of one column- or row-parallel linear layer `base` (not registered
    in it: the base calls `column` or `row_delta`). `parts`: the name of each logical
    part of the base's output (qkv: q, k, v; fc1 gated: gate, up); `targets`: those
    adapted, each its own A and B (PEFT's lora_A / lora_B of that projection)."""

    def __init__(self, base: nn.Module, parts: tuple[str, ...], targets: list[str], rank: int,
                 alpha: float, seed: int) -> None:
        super().__init__()
        self.column_parallel = base.split.dim == 0
        self.parts, self.targets, self.rank, self.seed = parts, targets, rank, seed
        self.scale = alpha / rank
        group, kw = base.group, dict(device=base.weight.device, dtype=base.weight.dtype)
        self.tp, self.tp_rank, self.in_features = group.size, group.rank, base.in_features
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        for t in targets:
            if self.column_parallel:  # B: the part's rows of the base's split; A replicated
                split = part_split(base.split, parts.index(t))
                rows = split.local_size(group.rank, group.size)
                self.A[t] = _tagged(torch.empty(rank, base.in_features, **kw), partial=True)
                self.B[t] = _tagged(torch.empty(rows, rank, **kw), split=split)
            else:  # A: the base's input columns; B replicated
                cols = base.split.local_size(group.rank, group.size)
                self.A[t] = _tagged(torch.empty(rank, cols, **kw), split=base.split)
                self.B[t] = _tagged(torch.empty(base.out_features, rank, **kw), partial=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A drawn whole from the seed (Kaiming-uniform, as PEFT), this rank's slice; B zero."""
        if any(p.is_meta for p in self.parameters()):
            return
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            for t in self.targets:
                g = torch.Generator().manual_seed(seed_for(self.seed, t))
                full = (torch.rand((self.rank, self.in_features), generator=g) * 2 - 1) * bound
                split = meta_of(self.A[t]).split
                self.A[t].copy_(full if split is None else
                                shard(full, split, self.tp_rank, self.tp))
                self.B[t].zero_()

    def _block_b(self, split: TPSplit) -> torch.Tensor:
        """The B of every part side by side [out/tp, R]: part i's rows hold its B in
        its target's r columns, zeros elsewhere (an untargeted part: zeros)."""
        r, width = self.rank, self.rank * len(self.targets)
        ref = next(iter(self.B.values()))
        rows = []
        for i, name in enumerate(self.parts):
            n = split.part_range(i, self.tp_rank, self.tp)[1]
            if name not in self.targets:
                rows.append(ref.new_zeros(n, width))
                continue
            j = self.targets.index(name)
            rows.append(F.pad(self.B[name], (j * r, width - (j + 1) * r)))
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def column(self, x: torch.Tensor, base: nn.Module) -> torch.Tensor:
        """The column-parallel base with its adapters: x [b, s, in] -> [b, s, out/tp]."""
        a = torch.cat([self.A[t] for t in self.targets]) if len(self.targets) > 1 \
            else self.A[self.targets[0]]  # [R, in]
        b = self._block_b(base.split)  # [out/tp, R]
        group, sp = base.group, base.sequence_parallel
        if group.size == 1 or not (sp or torch.is_grad_enabled()):
            return F.linear(x, base.weight, base.bias) + self.scale * F.linear(F.linear(x, a), b)
        return _ColumnLoRA.apply(x, base.weight, base.bias, a, b, self.scale, group, sp)

    def row_delta(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the row-parallel adapter's output: s B (A_r x_r), [b, s, out]
        (summed over tp with the base's partial products)."""
        t = self.targets[0]
        return self.scale * F.linear(F.linear(x, self.A[t]), self.B[t])

    def extra_repr(self) -> str:
        return f"targets={self.targets}, rank={self.rank}, scale={self.scale:g}"


def part_split(split: TPSplit, i: int) -> TPSplit:
    """Part `i` of a fused split alone (its rows dealt over tp as in the fused tensor)."""
    return TPSplit(split.dim, (split.parts[i],), (split.units[i],), (split.reads[i],))


def _tagged(t: torch.Tensor, *, split: TPSplit | None = None, partial: bool = False
            ) -> nn.Parameter:
    return set_meta(nn.Parameter(t), split=split, sequence_parallel=partial, adapter=True)


def layer_parts(c: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """(LoRA target name, output rows) of each part of each adaptable linear of a block,
    by its path in the block (`tpkit.model.block.Block`): the fused qkv, attention's
    out, the MLP's two."""
    q, kv = c.num_heads * c.head_dim, c.kv_heads * c.head_dim
    out = {"attn.qkv": (("q", q), ("k", kv), ("v", kv)), "attn.out": (("o", c.hidden),)}
    if not c.num_experts:
        fc1 = (("gate", c.ffn), ("up", c.ffn)) if c.gated else (("up", c.ffn),)
        out |= {"mlp.fc1": fc1, "mlp.fc2": (("down", c.hidden),)}
    return out


def attach(block: nn.Module, c: ModelConfig, seed: int) -> None:
    """Give the linear layers of `block` their adapters, as `c.lora_targets` asks."""
    for path, named in layer_parts(c).items():
        names = tuple(n for n, _ in named)
        targets = [t for t in names if t in c.lora_targets]
        if targets:
            linear = block.get_submodule(path)
            linear.lora = LoRA(linear, names, targets, c.lora_rank, c.lora_alpha,
                               seed_for(seed, path))


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train: every other parameter stops taking gradients."""
    for p in model.parameters():
        p.requires_grad_(meta_of(p).adapter)


def reset_adapters(model: nn.Module) -> None:
    """Draw every adapter of `model` again from its seed (after a meta build)."""
    for m in model.modules():
        if isinstance(m, LoRA):
            m.reset_parameters()


def merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + s B A: a weight [out, in] with its adapter folded in (any matching slices:
    a rank's rows of B with the whole A, or the whole B with a rank's columns of A)."""
    return w + scale * (b.to(torch.float32) @ a.to(torch.float32)).to(w.dtype)


def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its base weight, on this rank's slices, and drop it (a
    decode-only model: `decode.forms.for_decode`)."""
    for m in list(model.modules()):
        lora = getattr(m, "lora", None)
        if not isinstance(lora, LoRA):
            continue
        with torch.no_grad():
            if lora.column_parallel:
                rows = []
                for i, name in enumerate(lora.parts):
                    at = sum(m.split.part_range(j, lora.tp_rank, lora.tp)[1] for j in range(i))
                    n = m.split.part_range(i, lora.tp_rank, lora.tp)[1]
                    w = m.weight[at:at + n]
                    rows.append(merged(w, lora.A[name], lora.B[name], lora.scale)
                                if name in lora.targets else w)
                m.weight.copy_(torch.cat(rows))
            else:
                t = lora.targets[0]
                m.weight.copy_(merged(m.weight, lora.A[t], lora.B[t], lora.scale))
        m.lora = None
