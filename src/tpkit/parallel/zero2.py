"""ZeRO-2: gradients and AdamW state sharded over dp, weights replicated.

Rajbhandari et al. 2020, "P_os+g". Like ZeRO-1 (`tpkit.parallel.zero`) each dp rank
updates only its 1/dp slice of the flattened parameters; unlike it, the full
gradients never outlive the backward that made them. Parameters are packed into one
bucket per layer (and one for the embedding, final norm and head; the tied table alone
with pp > 1); as soon as every parameter of a bucket has its gradient from a
micro-batch, the bucket is reduce-scattered over dp and its full gradients are dropped,
so at most one layer's full gradients exist at a time. The weights are views of each
bucket's flat buffer; this rank's slice of it is what AdamW updates, in place:

    micro-batch i backward:  bucket k ready -> reduce_scatter(dp) / dp -> grad shard k += it
    after the last one:      norm and clip on the shards; AdamW on the shards
    after the step:          all_gather(dp) of each bucket's updated shard -> the weights

Per step and bucket: m reduce-scatters and one all-gather of the padded bucket
(`tpkit.spec.theory.data_parallel(..., zero2=True)`); with one micro-batch the ring
bytes of one all-reduce, as ZeRO-1 and plain data parallelism.
"""

from __future__ import annotations

from torch import nn

from tpkit.mesh import ParallelMesh
from tpkit.parallel.flat_units import FlatUnit
from tpkit.parallel.sharded import ShardedData, sharded_params, split_tied
from tpkit.spec import theory


class Zero2(ShardedData):
    """ZeRO-2 over `mesh.dp_cp_group` for this rank's stage of `model`."""

    scope = "zero2"

    def __init__(self, model: nn.Module, mesh: ParallelMesh, micro_batches: int,
                 weight_decay: float, **adamw) -> None:
        parts = split_tied(sharded_params(model), model, mesh.pp_size)
        units = [FlatUnit(n, ps, mesh.dp_cp_group, mesh.tp_group, mesh.pp_size, shard_is_view=True)
                 for n, ps in parts if ps]
        super().__init__(units, mesh, micro_batches, weight_decay, **adamw)

    def unit_backward_done(self, unit: FlatUnit, count: int) -> None:
        """Reduce-scatter this micro-batch's gradients of the bucket at once."""
        unit.reduce(self.scope)

    def after_step(self) -> None:
        """Every rank's updated slices into the replicated weights (one all-gather each)."""
        for u in self.units:
            u.publish(self.scope)

    def expected(self) -> list[theory.Expect]:
        """m reduce-scatters and one all-gather of each padded bucket."""
        dp = self.mesh.dp_cp_size
        return [e for u in self.units for e in
                theory.data_parallel(u.padded, dp, zero2=True, micro_batches=self.micro_batches)]

