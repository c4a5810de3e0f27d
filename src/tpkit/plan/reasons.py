"""One-line reasons: why the best plan wins, and what each other plan pays for its choices.

    best   "tp=8 keeps its 4 all-reduces per layer on NVLink 3 (0.5 s/step); pp=8 ..."
    other  "tp=16 would cross the node boundary: 4 all-reduces per layer over InfiniBand
            HDR x8 NICs add 38 ms per step"

The sentence for another plan names the term of the step time that grew most compared
with the best plan (compute, tp collectives, bubble, stage-to-stage sends, dp sync,
optimizer) and the choice that made it grow.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tpkit.plan import cost
from tpkit.plan.layout import ZERO_NAMES
from tpkit.spec.config import ModelConfig
from tpkit.spec.grid import group_fits_node
from tpkit.spec.theory import bubble_theory
from tpkit.spec.words import plural

if TYPE_CHECKING:
    from tpkit.plan.simulate import Cluster, Estimate, Layout


def gb(nbytes: float) -> str:
    """Bytes as GB with two significant digits below 10: 71 GB, 3.4 GB, 0.0081 GB."""
    v = nbytes / 1e9
    if v >= 10 or v <= 0:
        return f"{v:.0f} GB"
    return f"{v:.{max(1, 1 - math.floor(math.log10(v)))}f} GB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def collectives_phrase(lay: Layout) -> str:
    """What tensor parallelism sends per layer (forward + backward) for this layout."""
    if lay.tp == 1:
        return "no tensor-parallel collectives"
    k = 6 if lay.recompute == "full" else 4
    if lay.sp:  # each all-reduce becomes an all-gather + a reduce-scatter of the same bytes
        return f"{k} all-gathers + {k} reduce-scatters per layer"
    return f"{k} all-reduces per layer"


def _crosses(lay: Layout, cluster: Cluster) -> bool:
    return not group_fits_node(lay.tp, cluster.per_node)


def explain(e: Estimate, best: Estimate, c: ModelConfig, seq: int, cluster: Cluster) -> str:
    """The one-line reason for plan `e`, given the best plan."""
    if e is best:
        return _why_best(e, c, cluster)
    if e.step_time_s - best.step_time_s <= 0.005 * best.step_time_s:
        lay = e.layout
        return (f"as fast as the best plan (within 0.5%): the same work per rank, split as "
                f"tp={lay.tp} cp={lay.cp} pp={lay.pp} dp={lay.dp} micro-batch "
                f"{lay.micro_batch}")
    deltas = {k: e.terms[k] - best.terms[k] for k in e.terms}
    term = max(deltas, key=deltas.get)
    extra = max(deltas[term], 0.0)
    total = e.step_time_s - best.step_time_s
    say = {"tp_comm": _tp_comm, "bubble": _bubble, "compute": _compute, "p2p": _p2p,
           "dp": _dp, "optimizer": _optimizer}[term]
    return say(e, best, c, cluster, extra) + f" ({_ms(total)} per step slower in all)"


def _why_best(e: Estimate, c: ModelConfig, cluster: Cluster) -> str:
    lay, hw = e.layout, cluster.hardware
    link = cost.link_for(lay.tp, cluster.profile)
    parts = [f"fastest: tp={lay.tp} " + (
        f"keeps its {collectives_phrase(lay)} on {link.name} "
        f"({e.terms['tp_comm'] / e.step_time_s:.0%} of the step)" if lay.tp > 1
        else "(no tensor-parallel traffic needed)")]
    if lay.pp > 1:
        parts.append(f"pp={lay.pp} idles {e.terms['bubble'] / e.step_time_s:.0%} in the bubble "
                     f"with {plural(e.micro_batches, 'micro-batch')}")
    if lay.cp > 1:
        hidden = e.per_layer["cp_ring_exposed"] == 0
        parts.append(f"cp={lay.cp} splits each sequence over a ring of {lay.cp} ranks, its "
                     f"key/value sends {'hidden behind' if hidden else 'longer than'} attention")
    savers = [s for s, on in (("sequence parallel", lay.sp), (ZERO_NAMES[lay.zero], lay.zero),
                              (f"{lay.recompute} recompute", lay.recompute != "none"),
                              (f"{lay.interleave} chunks/device", lay.interleave > 1)) if on]
    cap = hw.accelerator.memory_bytes / 1e9
    parts.append(f"{gb(e.memory['total'])} of {cap:.0f} GB"
                 + (f" with {', '.join(savers)}" if savers else ""))
    return "; ".join(parts)


def _tp_comm(e, best, c, cluster, extra) -> str:
    lay = e.layout
    link = cost.link_for(lay.tp, cluster.profile)
    if _crosses(lay, cluster):
        return (f"tp={lay.tp} would cross the node boundary: {collectives_phrase(lay)} over "
                f"{link.name} add {_ms(extra)} per step")
    return (f"tp={lay.tp}: {collectives_phrase(lay)} on {link.name} over "
            f"{c.num_layers // lay.pp} layers per stage add {_ms(extra)} per step")


def _bubble(e, best, c, cluster, extra) -> str:
    lay = e.layout
    frac = bubble_theory(lay.pp, e.micro_batches, lay.interleave)
    return (f"pp={lay.pp} with {plural(e.micro_batches, 'micro-batch')} per replica: the pipeline "
            f"bubble ((p-1)/m = {frac:.0%}) adds {_ms(extra)} per step")


def _compute(e, best, c, cluster, extra) -> str:
    lay, b = e.layout, best.layout
    if lay.recompute == "full" and b.recompute != "full":
        return f"full recomputation re-runs every forward: +{_ms(extra)} per step"
    if e.notes.get("tp_imbalance", 0) > best.notes.get("tp_imbalance", 0) + 0.01:
        heads = -(-c.num_heads // lay.tp)
        return (f"tp={lay.tp} on {c.num_heads} heads: the larger rank does {heads}/"
                f"{c.num_heads} of the attention, {e.notes['tp_imbalance']:.0%} above an even "
                f"split: +{_ms(extra)} per step")
    if lay.tp > b.tp:
        eff = cost.gemm_efficiency(cluster.hardware.accelerator, c.hidden / lay.tp)
        return (f"tp={lay.tp} leaves {c.hidden // lay.tp}-wide GEMMs that run at {eff:.0%} of "
                f"peak: +{_ms(extra)} per step")
    if lay.pp > b.pp and e.notes.get("stage_imbalance", 0) > 0.05:
        return (f"pp={lay.pp}: the slowest stage (embedding or logits, V={c.vocab_size}) does "
                f"{e.notes['stage_imbalance']:.0%} more than the lightest: +{_ms(extra)} per step")
    if lay.micro_batch < b.micro_batch:
        return f"micro-batch {lay.micro_batch} runs smaller kernels: +{_ms(extra)} per step"
    return f"compute takes {_ms(extra)} more per step (GEMM shapes, elementwise traffic)"


def _p2p(e, best, c, cluster, extra) -> str:
    lay = e.layout
    link = cost.p2p_link(lay.tp * lay.pp, cluster.profile)
    return (f"pp={lay.pp}: stage-to-stage sends of {e.micro_batches * lay.interleave} "
            f"micro-batches over {link.name} add {_ms(extra)} per step")


def _dp(e, best, c, cluster, extra) -> str:
    lay = e.layout
    what = {0: "gradient all-reduce", 1: "gradient reduce-scatter + weight all-gather (ZeRO-1)",
            2: "per-micro-batch gradient reduce-scatters (ZeRO-2)",
            3: "per-layer weight all-gathers and gradient reduce-scatters (FSDP)"}[lay.zero]
    if lay.keeps_gathered_weights:
        what = "weight all-gather and gradient reduce-scatter once per step (FSDP, after-step)"
    return (f"dp={lay.dp}{f' x cp={lay.cp}' if lay.cp > 1 else ''}: the {what} that compute "
            f"cannot hide adds {_ms(extra)} per step")


def _optimizer(e, best, c, cluster, extra) -> str:
    lay = e.layout
    return (f"optimizer step over {'1/dp of ' if lay.zero else 'all '}the local parameters "
            f"adds {_ms(extra)} per step")
