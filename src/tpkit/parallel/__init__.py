"""Pipeline and data parallelism around the tensor-parallel model (quiz answer 6).

    p2p.py            StageLink: activations / gradients between neighbouring stages
    schedules.py      GPipe, 1F1B, interleaved 1F1B, forward-only (bubble: spec.theory)
    data_parallel.py  bucketed dp gradient all-reduce; tied-embedding group first<->last stage
    grad_norm.py      global gradient norm counting every parameter once; clipping
    zero.py           ZeRO-1: AdamW state sharded over dp
    flat_units.py     a unit of parameters as one flat buffer sharded over dp
    sharded_adamw.py  AdamW on the units' shards (per-parameter state in checkpoints)
    sharded.py        what ZeRO-2 and FSDP share: hooks at the end of each unit's backward
    zero2.py          ZeRO-2: gradients and AdamW state sharded, weights replicated
    fsdp.py           FSDP (ZeRO-3): weights too, gathered per layer just before use
    parallelize.py    tp on a user's own nn.Module from a plan of module names (`tpkit.parallelize`)
"""

from tpkit.parallel.data_parallel import (
    OverlappedGradSync,
    allreduce_grads,
    sync_tied_grads,
    tied_embedding_group,
)
from tpkit.parallel.grad_norm import clip_grads, global_grad_norm
from tpkit.parallel.p2p import StageLink, ring_backward_group
from tpkit.parallel.schedules import (
    SCHEDULES,
    MicroBatch,
    StepStats,
    forward_only,
    interleaved_order,
    run_schedule,
)
from tpkit.parallel.zero import ZeroAdamW

__all__ = [
    "SCHEDULES",
    "MicroBatch",
    "OverlappedGradSync",
    "StageLink",
    "StepStats",
    "ZeroAdamW",
    "allreduce_grads",
    "clip_grads",
    "forward_only",
    "global_grad_norm",
    "interleaved_order",
    "ring_backward_group",
    "run_schedule",
    "sync_tied_grads",
    "tied_embedding_group",
]
