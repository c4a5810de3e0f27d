"""One training step, and what it needs, gathered once per run in a `StepContext`.

    ctx = StepContext(cfg, mesh, model, link, opt, data_parallel, tied, mixed, autocast)
    row = run_step(ctx, loader, step)          # the metrics row of one optimizer step
    val = evaluate(ctx, val_loader)            # mean held-out loss

A step (every rank runs it):

    batch of this dp replica -> m micro-batches -> GPipe / 1F1B / interleaved 1F1B
    dp.arm() ... dp.finish()         dp: gradients summed as the last backward finishes
                                     them (replicated), or reduce-scattered (ZeRO-2, FSDP)
    model.finalize_grads()           tp: sequence-parallel norms, shared kv heads
    dp.sync_tied(tied)               pp: embedding (first stage) + head (last stage);
                                     ZeRO-1: the optimizer's reduce-scatter over dp
    (all of these are sums, so their order does not change the result)
    dp.grad_norm()                   every parameter counted once (tp, pp; not dp)
    guard.skip(loss, norm)           a NaN/inf: stop the run, or skip this update
    dp.clip; optimizer.step(); dp.after_step()
    mixed.copy_to_compute()          bf16 compute copy of fp32 master weights

`dp` (`ctx.data_parallel`) is `parallel.replicated_data.ReplicatedData` or
`parallel.sharded.ShardedData`: one protocol, so the step has one path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tpkit.comm import all_reduce
from tpkit.comm.group import CommGroup
from tpkit.mesh import ParallelMesh
from tpkit.parallel import StageLink, context, forward_only, run_schedule
from tpkit.train import run_log
from tpkit.train.config import TrainConfig
from tpkit.train.data import TokenLoader, micro_batches
from tpkit.train.master import MasterWeights
from tpkit.train.nonfinite import NonFiniteGuard
from tpkit.train.optim import lr_at, set_lr


@dataclass
class StepContext:
    """Everything a step reads, built once by `loop.train`."""

    cfg: TrainConfig
    mesh: ParallelMesh
    model: nn.Module  # the stage the schedule runs (FSDP: its root unit gathered)
    link: StageLink
    opt: Any  # a `replicated.StepOptimizer`, or ZeRO-2 / FSDP's sharded AdamW
    data_parallel: Any  # ReplicatedData or ShardedData (the dp protocol; cfg.data: a path)
    tied: CommGroup | None = None  # first + last stage, for a tied embedding
    mixed: MasterWeights | None = None  # bf16 forward/backward on fp32 master weights
    autocast: Any = None  # torch.autocast for bf16 without master weights
    guard: NonFiniteGuard | None = None  # a NaN/inf loss or norm: stop, or skip the update
    cp_group: CommGroup | None = None  # context parallelism: each rank its s/cp tokens

    @property
    def compute(self) -> nn.Module:
        """The model forward and backward run on (the bf16 copy with master weights)."""
        return self.mixed.compute if self.mixed else self.model

    def batches(self, loader: TokenLoader) -> list:
        """The next batch of `loader`, on the device, as the run's micro-batches."""
        ids, labels = context.local_chunks(*loader.next_batch(), self.cp_group)  # [G/dp, s/cp]
        m = self.cfg.micro_batches
        # masked labels (--loss-on assistant): each micro-batch's loss is its sum over the
        # batch's counted labels, times m * dp * cp (the schedule's mean over micro-batches
        # and the gradients' over dp x cp undo it): the step's loss is the masked mean
        divide_by = None if loader.counted is None else \
            max(loader.counted, 1) / (m * self.mesh.dp_cp_size)
        return micro_batches(ids.to(self.mesh.device), labels.to(self.mesh.device), m,
                             divide_by)


def run_step(ctx: StepContext, loader: TokenLoader, step: int) -> dict:
    """One optimizer step; returns its metrics row."""
    cfg, t0 = ctx.cfg, time.perf_counter()
    lr = lr_at(step, cfg)
    set_lr(ctx.opt, lr)
    micro = ctx.batches(loader)
    ctx.data_parallel.arm()
    stats = run_schedule(cfg.schedule, ctx.compute, ctx.link, micro, ctx.autocast)
    ctx.data_parallel.finish()  # most buckets were sent during the last backward
    ctx.model.finalize_grads()
    ctx.data_parallel.sync_tied(ctx.tied)
    norm = ctx.data_parallel.grad_norm()
    loss = replica_mean(stats.loss, ctx.mesh)  # before the update: a NaN step never applies
    skipped = bool(ctx.guard and ctx.guard.skip(step + 1, loss, norm, ctx.model,
                                                ctx.mesh.rank))  # the same on every rank
    if not skipped:
        ctx.data_parallel.clip(norm, cfg.clip)
        ctx.opt.step()
    ctx.opt.zero_grad(set_to_none=True)
    ctx.data_parallel.after_step()  # ZeRO-2: all-gather the weights; FSDP: free them
    if ctx.mixed and not skipped:
        ctx.mixed.copy_to_compute()
    comm = run_log.comm_by_group(ctx.mesh.ledger.records)
    return dict(step=step + 1, loss=loss, lr=lr, grad_norm=norm, idle_s=stats.idle_s,
                skipped=skipped, schedule_s=stats.total_s, max_inflight=stats.max_inflight,
                step_s=time.perf_counter() - t0, comm=comm,
                tokens=(step + 1) * cfg.global_batch * cfg.seq)


def evaluate(ctx: StepContext, loader: TokenLoader) -> float:
    """Mean validation loss over the first `cfg.eval_batches` held-out batches."""
    model = ctx.compute
    model.eval()
    loader.position, losses = 0, []
    for _ in range(ctx.cfg.eval_batches):
        stats = forward_only(model, ctx.link, ctx.batches(loader), ctx.autocast)
        losses.append(replica_mean(stats.loss, ctx.mesh))
    model.train()
    ctx.data_parallel.release()  # FSDP: the parameters the forward gathered
    return sum(losses) / len(losses)


def replica_mean(value: float | None, mesh: ParallelMesh) -> float:
    """The last stage's value, averaged over the dp x cp ranks, known on every rank."""
    t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64,
                     device=mesh.device)
    if mesh.tp_rank != 0:
        t.zero_()  # every tp rank of the last stage holds it; count one
    all_reduce(t, mesh.mp_group, phase="metrics", scope="metrics")
    all_reduce(t, mesh.dp_cp_group, phase="metrics", scope="metrics")
    return t.item() / mesh.dp_cp_size
