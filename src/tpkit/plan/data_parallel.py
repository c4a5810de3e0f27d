"""Data-parallel time per step for each sharding stage (see `layout.py` for the names).

N = dp x cp ranks hold the same weights; G = gradient bytes, W = weight bytes of one
rank (its tp/pp shard). Collectives come from the spec's theory where tpkit runs them
(plain and ZeRO-1: `tpkit.spec.theory.data_parallel`), priced with the ring model:

    stage     per step                              overlapped with
    none      all-reduce G                          the last micro-batch's backward
    ZeRO-1    reduce-scatter G, all-gather W        RS: last backward; AG: not (after the step)
    ZeRO-2    m x reduce-scatter G, all-gather W    each RS: its micro-batch's backward
    FSDP      m x (AG W forward, AG W + RS G        forward / backward compute of the
              backward), layer by layer             micro-batch, prefetching the next layer;
                                                    the first layer's gather is exposed

Megatron overlaps the ZeRO-1 reduce-scatter with backward (--overlap-grad-reduce);
tpkit's own `ZeroAdamW` runs it after backward, so on tpkit it is exposed.
"""

from __future__ import annotations

from tpkit.plan import cost
from tpkit.plan.hardware import Link
from tpkit.plan.layout import Layout
from tpkit.spec import theory

_PRICE = {"all_reduce": cost.all_reduce_time, "reduce_scatter": cost.reduce_scatter_time,
          "all_gather": cost.all_gather_time}


def step_collectives(params: int, lay: Layout) -> list[theory.Expect]:
    """The spec's dp collectives of one step (plain, or ZeRO-1 and up: RS + AG)."""
    return theory.data_parallel(params, lay.replicas, zero1=lay.zero >= 1)


def price(e: theory.Expect, n: int, link: Link, grad_bytes: int, weight_bytes: int) -> float:
    """Seconds of one theory collective: gradients in their dtype, gathered weights in theirs."""
    per = weight_bytes if e.op == "all_gather" else grad_bytes
    return e.count * _PRICE[e.op](e.numel * per, n, link)


def dp_time(params: int, layer_count: int, lay: Layout, link: Link, grad_bytes: int,
            weight_bytes: int, m: int, fwd: float, bwd: float, overlap: bool = True) -> float:
    """Seconds the dp collectives add to a step, after overlap with compute.

    `fwd`, `bwd`: one micro-batch's forward and backward compute on this stage.
    """
    n = lay.replicas
    if n == 1:
        return 0.0
    rs = cost.reduce_scatter_time(params * grad_bytes, n, link)
    ag = cost.all_gather_time(params * weight_bytes, n, link)
    if lay.zero <= 1:
        parts = {e.op: price(e, n, link, grad_bytes, weight_bytes)
                 for e in step_collectives(params, lay)}
        sync = parts.get("all_reduce", 0.0) + parts.get("reduce_scatter", 0.0)
        return (max(sync - bwd, 0.0) if overlap else sync) + parts.get("all_gather", 0.0)
    if lay.zero == 2:
        return m * (max(rs - bwd, 0.0) if overlap else rs) + ag
    if not overlap:
        return m * (2 * ag + rs)
    first = ag / max(layer_count, 1)  # nothing to hide the first layer's gather behind
    return m * (max(ag - fwd, 0.0) + max(ag + rs - bwd, 0.0) + 2 * first)


def optimizer_shards(lay: Layout) -> int:
    """How many ranks split the optimizer step: dp x cp with ZeRO-1 and up, else 1."""
    return lay.replicas if lay.zero >= 1 else 1
