"""What ZeRO-2 and FSDP share: flat units, gradients reduce-scattered as backward ends.

    step:  arm()                          before the first micro-batch
           backward of each micro-batch   a unit whose every parameter has its gradient
                                          (or, at the end of that backward, any unit that
                                          got some) is handed to `unit_backward_done`:
                                          ZeRO-2 and FSDP reduce-scatter it over dp there
           sync_tied(group)               pp: the tied embedding's gradient shard summed
                                          between first and last stage (same dp slice)
           grad_norm() -> clip(norm, c)   on the gradient shards, weighted as unsharded
           optimizer.step()               `ShardedAdamW` on the shards
           after_step()                   ZeRO-2: all-gather the weights; FSDP: free them

The per-step dp collectives are what `expected()` lists, from `tpkit.spec.theory`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from tpkit.comm import all_reduce
from tpkit.comm.group import CommGroup
from tpkit.mesh import ParallelMesh
from tpkit.parallel.data_parallel import tied_params
from tpkit.parallel.flat_units import FlatUnit
from tpkit.parallel.sharded_adamw import ShardedAdamW
from tpkit.spec.theory import Expect


class ShardedData:
    """Base of `Zero2` and `FullyShardedData`: the units, their hooks, norm and clip."""

    scope = "sharded"

    def __init__(self, units: list[FlatUnit], mesh: ParallelMesh, micro_batches: int,
                 weight_decay: float, **adamw) -> None:
        self.units, self.mesh, self.micro_batches = units, mesh, micro_batches
        self.unit_of = {id(p): u for u in units for p in u.params}
        self.seen: dict[int, int] = {}  # id(unit) -> parameters with a gradient, this backward
        self.backwards: dict[int, int] = {}  # id(unit) -> backward passes through it, this step
        self._queued = False
        self.optimizer = ShardedAdamW(units, weight_decay, **adamw)
        for u in units:
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    # -- backward ------------------------------------------------------------------------
    def arm(self) -> None:
        """Call before the step's first backward."""
        self.seen.clear()
        self.backwards.clear()

    def finish(self) -> None:
        """After the schedule: nothing left (every unit was handled inside its backward)."""

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._queued:  # once per backward pass: look at every unit when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        u = self.unit_of[id(p)]
        self.seen[id(u)] = self.seen.get(id(u), 0) + 1
        if self.seen[id(u)] == len(u.params):
            self._done(u)

    def _end_of_backward(self) -> None:
        self._queued = False
        for u in self.units:
            if self.seen.get(id(u), 0) > 0:
                self._done(u)

    def _done(self, u: FlatUnit) -> None:
        self.seen[id(u)] = 0
        self.backwards[id(u)] = self.backwards.get(id(u), 0) + 1
        self.unit_backward_done(u, self.backwards[id(u)])

    def unit_backward_done(self, unit: FlatUnit, count: int) -> None:
        """Unit `unit` finished its `count`-th backward of the step (subclasses act)."""
        raise NotImplementedError

    # -- between backward and the optimizer --------------------------------------------------
    def sync_tied(self, group: CommGroup | None) -> None:
        """Sum the tied embedding's gradient shard between the first and last stage."""
        if group is None:
            return
        tied = [u for u in self.units if u.name == "tied"]
        if len(tied) != 1:
            raise RuntimeError(f"expected one tied unit on this stage, found {len(tied)}")
        u = tied[0]
        if u.grad_shard is None:
            u.grad_shard = torch.zeros_like(u.shard)
        all_reduce(u.grad_shard, group, phase="grads", scope="tied_embedding")

    def grad_norm(self) -> float:
        """||g||_2 of one replica, from the shards (tp x pp, then dp sums)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for u in self.units:
            sq += u.sq_norm()
        all_reduce(sq, self.mesh.mp_group, phase="grads", scope="grad_norm")
        all_reduce(sq, self.mesh.dp_cp_group, phase="grads", scope="grad_norm")
        return math.sqrt(sq.item())

    def clip(self, norm: float, max_norm: float) -> float:
        """Scale the gradient shards by min(1, max_norm / norm), as `clip_grads` does."""
        if max_norm <= 0 or norm <= max_norm or not math.isfinite(norm):
            return 1.0
        factor = max_norm / (norm + 1e-6)
        for u in self.units:
            if u.grad_shard is not None:
                u.grad_shard.mul_(factor)
        return factor

    def after_step(self) -> None:
        """After the optimizer step (subclasses: publish or free the weights)."""

    def release(self) -> None:
        """Free what forward gathered outside a training step (after an evaluation)."""

    def stage_model(self, model):
        """What the pipeline schedules run: the model itself (FSDP wraps it)."""
        return model

    # -- checkpoints and theory --------------------------------------------------------------
    @contextmanager
    def full_params(self):
        """The model's parameters materialized (checkpoint save / load); on exit the
        shards take what the parameters hold, and FSDP frees them again."""
        with self.mesh.ledger.paused():
            for u in self.units:
                u.gather("checkpoint", self.scope)
        try:
            yield
        finally:
            for u in self.units:
                u.take_from_params()
            self.release()

    def expected(self) -> list[Expect]:
        """The dp collectives one training step must record under this scope."""
        raise NotImplementedError


def sharded_params(model: nn.Module) -> list[tuple[str, list[nn.Parameter]]]:
    """(name, parameters) of each pipeline-stage part: every layer, then the rest."""
    layers = [(f"layers.{i}", list(layer.parameters())) for i, layer in model.layers.items()]
    in_layers = {id(p) for _, ps in layers for p in ps}
    rest = [p for p in model.parameters() if id(p) not in in_layers and p.requires_grad]
    return layers + [("rest", rest)]


def split_tied(parts: list[tuple[str, list[nn.Parameter]]], model: nn.Module, pp: int
               ) -> list[tuple[str, list[nn.Parameter]]]:
    """With pp > 1 and tied embeddings, the tied table (first stage) or head (last) gets a
    unit of its own, so both stages shard it alike and its gradient shards can be summed."""
    if pp == 1 or not model.config.tie_embeddings:
        return parts
    tied = tied_params(model)
    if not tied:  # a middle stage
        return parts
    ids = {id(p) for p in tied}
    out = [(n, [p for p in ps if id(p) not in ids]) for n, ps in parts]
    return [(n, ps) for n, ps in out if ps] + [("tied", tied)]
