"""FSDP (ZeRO-3): every parameter sharded over dp, one flat unit per transformer layer.

Rajbhandari et al. 2020 ("P_os+g+p"); PyTorch FSDP2's `fully_shard` per block. Each
rank keeps 1/dp of every layer's flattened (tp-local) weights, gradients and AdamW
state. A layer's weights exist in full only while it runs:

    forward of layer i:   all_gather(dp) unit i      (unit i+1's gather starts now, async:
                          run layer i                 it overlaps layer i's compute)
                          after-forward: free unit i
    backward of layer i:  (after-forward) all_gather unit i again when the gradient of its
                          output arrives (unit i-1's gather prefetched)
                          run its backward; its gradients -> reduce_scatter(dp) / dp ->
                          the gradient shard; full gradients and (after-forward) weights freed

`--fsdp-reshard after-step` gathers each unit once, at its first forward of the step,
keeps it for the step and reduce-scatters the summed gradients after the last
micro-batch's backward only. The embedding, final norm and head form one more unit
(the tied table alone with pp > 1), gathered for the first and last chunks of the
pipeline. Per step and unit the dp group sends `tpkit.spec.theory.fully_sharded`:
m x (AG forward + AG backward + RS) after-forward, AG + RS after-step.

With tp, each rank shards its own tp shard over its dp group (2D); with pp, each
stage shards its own layers. With full recompute the forward rerun inside backward
gathers the unit (recorded as backward) and keeps it until its gradients are reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.mesh import ParallelMesh
from tpkit.parallel.flat_units import FlatUnit
from tpkit.parallel.sharded import ShardedData, sharded_params, split_tied
from tpkit.spec import theory


class FullyShardedData(ShardedData):
    """FSDP over `mesh.dp_cp_group` for this rank's stage of `model` (see the module doc)."""

    scope = "fsdp"

    def __init__(self, model: nn.Module, mesh: ParallelMesh, micro_batches: int,
                 weight_decay: float, reshard: str = "after-forward", **adamw) -> None:
        if reshard not in theory.FSDP_RESHARD:
            raise ValueError(f"fsdp reshard={reshard!r} is not one of {theory.FSDP_RESHARD}")
        self.reshard, self.model = reshard, model
        parts = split_tied(sharded_params(model), model, mesh.pp_size)
        units = [FlatUnit(n, ps, mesh.dp_cp_group, mesh.tp_group, mesh.pp_size)
                 for n, ps in parts if ps]
        super().__init__(units, mesh, micro_batches, weight_decay, **adamw)
        self.layer_unit = {n: u for n, u in zip((n for n, ps in parts if ps), units)}
        self.root = [u for u in units if u.name in ("rest", "tied")]
        self._embed_out: torch.Tensor | None = None
        for c in range(model.virtual_stages):
            names = [f"layers.{i}" for i in model.chunk_layers[c]]
            for j, name in enumerate(names):
                nxt = self.layer_unit[names[j + 1]] if j + 1 < len(names) else None
                prev = self.layer_unit[names[j - 1]] if j > 0 else None
                self._hook_layer(model.layers[name.split(".")[1]], self.layer_unit[name], nxt,
                                 prev)
        if model.is_first_stage:
            model.embed.register_forward_hook(self._keep_embed_out)
        self.release()

    # -- forward / backward hooks ----------------------------------------------------------
    def _hook_layer(self, layer: nn.Module, unit: FlatUnit, nxt: FlatUnit | None,
                    prev: FlatUnit | None) -> None:
        def before(_module, _args):
            if _in_backward():  # full recompute: this forward is part of the backward
                unit.gather("backward", self.scope)
                if prev is not None:
                    prev.prefetch("backward", self.scope)
                return
            unit.gather("forward", self.scope)
            if nxt is not None:
                nxt.prefetch("forward", self.scope)

        def after(_module, _args, out):
            if self.reshard == "after-forward" and not _in_backward():
                unit.free()
                if torch.is_tensor(out) and out.requires_grad:
                    out.register_hook(lambda g: self._regather(unit, prev))
            return out

        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)

    def _regather(self, unit: FlatUnit, prev: FlatUnit | None) -> None:
        """The gradient of the unit's output arrived: its backward is next."""
        unit.gather("backward", self.scope)
        if prev is not None:
            prev.prefetch("backward", self.scope)

    def _keep_embed_out(self, _module, _args, out):
        self._embed_out = out
        return out

    def unit_backward_done(self, unit: FlatUnit, count: int) -> None:
        """after-forward: reduce-scatter now and free; after-step: on the last micro-batch."""
        if self.reshard == "after-forward":
            unit.reduce(self.scope)
            unit.free()
        elif count == self.micro_batches:
            unit.reduce(self.scope)

    # -- the stage model the schedules run ------------------------------------------------
    def stage_model(self, model):
        """`model`, with the embedding / head unit gathered around its first and last chunk."""
        return _RootGathering(self, model)

    def forward_chunk(self, model, c: int, x: torch.Tensor, **kw) -> torch.Tensor:
        """Chunk `c` of `model` (`kw`: its keywords); the root unit gathered for it when
        it needs it."""
        needs_root = model.chunk_is_first(c) or model.chunk_is_last(c)
        for u in self.root if needs_root else []:
            u.gather("forward", self.scope)
        self._embed_out = None
        out = model.forward_chunk(c, x, **kw)
        if needs_root and self.reshard == "after-forward":
            for u in self.root:
                u.free()
            # backward needs the head first (last chunk) or only the embedding (first chunk)
            anchor = out if model.chunk_is_last(c) else self._embed_out
            if anchor is not None and anchor.requires_grad:
                anchor.register_hook(lambda g: self._regather_root())
        self._embed_out = None
        return out

    def _regather_root(self) -> None:
        for u in self.root:
            u.gather("backward", self.scope)

    # -- step ------------------------------------------------------------------------------
    def after_step(self) -> None:
        """after-step: drop the weights kept for the step (after-forward: already gone)."""
        self.release()

    def release(self) -> None:
        """Free every unit's full buffer."""
        for u in self.units:
            u.wait()
            u.free()

    def expected(self) -> list[theory.Expect]:
        """`theory.fully_sharded` of each unit's padded flat buffer."""
        dp, m = self.mesh.dp_cp_size, self.micro_batches
        return [e for u in self.units for e in theory.fully_sharded(u.padded, dp, m, self.reshard)]


def _in_backward() -> bool:
    """Is autograd running a backward pass now (a recomputed forward runs inside one)?"""
    return torch._C._current_graph_task_id() != -1


class _RootGathering:
    """The model as the schedules see it, with `forward_chunk` going through FSDP."""

    def __init__(self, fsdp: FullyShardedData, model: nn.Module) -> None:
        self._fsdp, self._model = fsdp, model

    def forward_chunk(self, c: int, x: torch.Tensor, **kw) -> torch.Tensor:
        """The model's chunk `c`, with the root unit gathered as needed."""
        return self._fsdp.forward_chunk(self._model, c, x, **kw)

    def __getattr__(self, name: str):
        return getattr(self._model, name)
