"""Replicated data parallelism (plain AdamW, or ZeRO-1), under the protocol that ZeRO-2
and FSDP (`sharded.ShardedData`) also follow, so that a training step has one path:

    data.arm(); <pipeline schedule>; data.finish()   gradients summed over dp as backward
                                                     finishes them (ZeRO-1: not here)
    model.finalize_grads()                           tp sums (SP norms, shared kv heads)
    data.sync_tied(tied)                             pp: embedding + head; ZeRO-1: the
                                                     optimizer reduce-scatters over dp
    norm = data.grad_norm(); data.clip(norm, max)    every parameter counted once
    optimizer.step(); data.after_step()

The optimizer says what it does with dp (`dp_sharded`: ZeRO-1 reduce-scatters the
gradients itself in `reduce_gradients`; plain AdamW's `reduce_gradients` does nothing):
one optimizer protocol, no type tests (`tpkit.train.optim.AdamW`, `zero.ZeroAdamW`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Protocol

from torch import nn

from tpkit.comm.group import CommGroup
from tpkit.mesh import ParallelMesh
from tpkit.parallel.data_parallel import OverlappedGradSync, sync_tied_grads
from tpkit.parallel.grad_norm import clip_grads, global_grad_norm


class StepOptimizer(Protocol):
    """What a training step asks of its optimizer (beside torch's step / zero_grad)."""

    dp_sharded: bool  # its state and gradient sums are split over dp (ZeRO-1)

    def reduce_gradients(self) -> None:
        """ZeRO-1: reduce-scatter the gradients over dp (each rank its slice); else nothing."""


class ReplicatedData:
    """Every dp replica holds the whole model; gradients are summed over dp while the
    last backward runs (`OverlappedGradSync`), or by a dp-sharded optimizer (ZeRO-1)."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, optimizer: StepOptimizer,
                 micro_batches: int) -> None:
        self.model, self.mesh, self.optimizer = model, mesh, optimizer
        params = [] if optimizer.dp_sharded else list(model.parameters())
        self.sync = OverlappedGradSync(params, mesh.dp_cp_group, micro_batches)

    def arm(self) -> None:
        """Before the schedule: start listening for the last micro-batch's gradients."""
        self.sync.arm()

    def finish(self) -> None:
        """After the schedule: wait for the last dp buckets."""
        self.sync.finish()

    def sync_tied(self, tied: CommGroup | None) -> None:
        """Sum the tied embedding's two uses over pp; ZeRO-1: reduce-scatter over dp."""
        sync_tied_grads(self.model, tied)
        self.optimizer.reduce_gradients()

    def grad_norm(self) -> float:
        """The global gradient norm, every parameter counted once."""
        return global_grad_norm(self.model, self.mesh, dp_sharded=self.optimizer.dp_sharded)

    def clip(self, norm: float, max_norm: float) -> float:
        """Scale the gradients so that their norm is at most `max_norm`; the factor used."""
        return clip_grads(self.model, norm, max_norm)

    def after_step(self) -> None:
        """Nothing: the optimizer updated whole parameters (ZeRO-1: and all-gathered them)."""

    def release(self) -> None:
        """Nothing to free (FSDP frees gathered parameters here)."""

    def stage_model(self, model: nn.Module) -> nn.Module:
        """The model the schedule runs: the model itself."""
        return model

    def full_params(self):
        """A context in which every parameter is whole: always (FSDP gathers them)."""
        return nullcontext()
