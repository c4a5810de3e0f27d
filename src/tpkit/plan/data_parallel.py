"""Data-parallel time per step for each sharding stage (see `layout.py` for the names).

N = dp x cp ranks hold the same weights; G = gradient bytes, W = weight bytes of one
rank (its tp/pp shard). Collectives come from the spec's theory where tpkit runs them
(plain and ZeRO-1: `tpkit.spec.theory.data_parallel`), priced with the ring model:

    stage     per step                              overlapped with
    none      all-reduce G                          the last micro-batch's backward
    ZeRO-1    reduce-scatter G, all-gather W        RS: last backward; AG: not (after the step)
    ZeRO-2    m x reduce-scatter G, all-gather W    each RS: the compute until the next
                                                    one (its backward and the next forward),
                                                    the last one: its backward only
    FSDP      m x (AG W forward, AG W + RS G        the same windows (the next forward
              backward), layer by layer             and backward), prefetching layer by
                                                    layer; the first layer's gather exposed
    FSDP,     AG W at the first forward, kept;      AG: the first micro-batch's forward,
    after-    RS G after the last backward          prefetching (first layer exposed);
    step      (`theory.fully_sharded`)              RS: the last micro-batch's backward

FSDP's counts come from `tpkit.spec.theory.fully_sharded` (`Layout.fsdp_reshard`). In a
pipeline the first stage starts the step and ends it (1F1B and interleaved alike), so
its first forward and last backward are the windows a per-step gather and reduce-scatter
can hide behind; the later stages gather while they wait for their first activations.

A collective issued once per micro-batch runs on its own stream while the rank computes:
it is exposed only where it outlasts the compute between two of its kind, one
micro-batch's forward and backward on this stage (a pipeline runs the next micro-batch's
forward, or another chunk's, while the last gradients are reduced); the step's last one
has only its own backward behind it.

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
        return (per_micro_batch(rs, m, fwd, bwd) if overlap else m * rs) + ag
    return fsdp_time(params, layer_count, lay, link, grad_bytes, weight_bytes, m, fwd, bwd,
                     overlap)


def fsdp_time(params: int, layer_count: int, lay: Layout, link: Link, grad_bytes: int,
              weight_bytes: int, m: int, fwd: float, bwd: float, overlap: bool = True) -> float:
    """Seconds FSDP's gathers and reduce-scatters add to a step (see the table above):
    each gather hides behind one micro-batch's forward but for its first layer; each
    reduce-scatter (and, after-forward, the backward's re-gather) behind one backward."""
    n = lay.replicas
    expects = theory.fully_sharded(params, n, m, lay.fsdp_reshard)
    if not overlap:
        return sum(price(e, n, link, grad_bytes, weight_bytes) for e in expects)
    rounds = {(e.op, e.phase): e.count for e in expects}
    once = {(e.op, e.phase): price(e, n, link, grad_bytes, weight_bytes) / e.count
            for e in expects}  # seconds of one occurrence of each
    ag, rs = once[("all_gather", "forward")], once[("reduce_scatter", "grads")]
    regather = once.get(("all_gather", "backward"), 0.0)
    first = ag / max(layer_count, 1)  # nothing to hide the first layer's gather behind
    gathers = rounds[("all_gather", "forward")]
    if gathers == 1:  # after-step: one gather behind the first forward, one RS at the end
        return max(ag - fwd, 0.0) + first + max(rs - bwd, 0.0)
    # after-forward: per micro-batch, gather, re-gather and reduce-scatter on one link
    busy = ag + regather + rs
    return per_micro_batch(busy, gathers, fwd, bwd) + gathers * first * (2 if regather else 1)


def per_micro_batch(seconds: float, m: int, fwd: float, bwd: float) -> float:
    """Exposed seconds of `m` collectives of `seconds` each, one per micro-batch: each hides
    behind the compute until the next is issued (a forward and a backward), the last
    behind its own backward only."""
    return (m - 1) * max(seconds - fwd - bwd, 0.0) + max(seconds - bwd, 0.0)


def optimizer_shards(lay: Layout) -> int:
    """How many ranks split the optimizer step: dp x cp with ZeRO-1 and up, else 1."""
    return lay.replicas if lay.zero >= 1 else 1
