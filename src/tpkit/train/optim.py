"""AdamW (optionally ZeRO-1, ZeRO-2 or FSDP sharded over dp) and the warmup + cosine learning rate.

    lr(t) = lr * (t+1)/warmup                                   t < warmup
          = min_lr + (lr - min_lr) * (1 + cos(pi * q)) / 2      q = (t-warmup)/(steps-warmup)

Weight decay applies to matrices (dim >= 2) only, not to biases and norm gains.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tpkit.mesh import ParallelMesh
from tpkit.parallel.fsdp import FullyShardedData
from tpkit.parallel.zero import ZeroAdamW
from tpkit.parallel.zero2 import Zero2
from tpkit.train.config import TrainConfig


class AdamW(torch.optim.AdamW):
    """torch's AdamW as a `parallel.replicated_data.StepOptimizer`: whole gradients, summed
    over dp before it runs, so `reduce_gradients` has nothing to do."""

    dp_sharded = False

    def reduce_gradients(self) -> None:
        """Nothing: `OverlappedGradSync` summed the gradients over dp already."""


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """[decayed matrices, undecayed vectors], in parameter order."""
    decay, plain = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else plain).append(p)
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=plain, weight_decay=0.0)]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: TrainConfig, mesh: ParallelMesh
                    ) -> AdamW | ZeroAdamW:
    """AdamW, or `ZeroAdamW` sharding its state over the dp x cp group with --zero1."""
    groups = param_groups(model, cfg.weight_decay)
    kw = dict(lr=cfg.lr, betas=(0.9, cfg.beta2), eps=1e-8)
    if cfg.zero1 and mesh.dp_cp_size > 1:
        return ZeroAdamW(groups, mesh.dp_cp_group, **kw)
    return AdamW(groups, **kw)


def build_sharding(model: nn.Module, cfg: TrainConfig, mesh: ParallelMesh):
    """`Zero2` (--zero2) or `FullyShardedData` (--fsdp) over the dp x cp group, or None (neither
    asked, or dp=1: nothing to shard over). Its `.optimizer` is the run's optimizer."""
    if mesh.dp_cp_size == 1 or not (cfg.zero2 or cfg.fsdp):
        return None

    kw = dict(lr=cfg.lr, betas=(0.9, cfg.beta2), eps=1e-8)
    if cfg.zero2:
        return Zero2(model, mesh, cfg.micro_batches, cfg.weight_decay, **kw)
    return FullyShardedData(model, mesh, cfg.micro_batches, cfg.weight_decay,
                            reshard=cfg.fsdp_reshard, **kw)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of step `step` (0-based): linear warmup, then cosine to min_lr."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    q = min((step - cfg.warmup) / span, 1.0)
    return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * q))


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every param group."""
    for g in optimizer.param_groups:
        g["lr"] = lr
