"""ZeRO-2: gradients and AdamW state sharded over dp, weights replicated.

Rajbhandari et al. 2020, "P_os+g". Like ZeRO-1 (`tpkit.parallel.zero`) each dp rank
updates only its 1/dp slice of the flattened parameters; unlike it, the full
gradients never outlive the backward that made them. Parameters are packed into
buckets (~`bucket_mb` MiB, in the order backward finishes them, last layer first);
as soon as every parameter of a bucket has its gradient from a micro-batch, the
bucket is reduce-scattered over dp and its full gradients are dropped:

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
    """ZeRO-2 over `mesh.dp_group` for this rank's stage of `model`."""

    scope = "zero2"

    def __init__(self, model: nn.Module, mesh: ParallelMesh, micro_batches: int,
                 weight_decay: float, bucket_mb: float = 25.0, **adamw) -> None:
        parts = split_tied(sharded_params(model), model, mesh.pp_size)
        tied = [ps for n, ps in parts if n == "tied"]
        order = [p for n, ps in reversed(parts) if n != "tied" for p in reversed(ps)]
        units = [FlatUnit(f"bucket{i}", ps, mesh.dp_group, mesh.tp_group, mesh.pp_size)
                 for i, ps in enumerate(_buckets(order, int(bucket_mb * 2**20)))]
        units += [FlatUnit("tied", ps, mesh.dp_group, mesh.tp_group, mesh.pp_size)
                  for ps in tied]
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
        dp = self.mesh.dp_size
        return [e for u in self.units for e in
                theory.data_parallel(u.padded, dp, zero2=True, micro_batches=self.micro_batches)]


def _buckets(params: list[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    """Consecutive groups of parameters, each at most `limit` bytes (or one parameter)."""
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out
