"""One plan, simulated: the step time of a (tp, pp, dp, micro-batch, ...) layout, term by term.

    step = m (t_stage)                      compute + tp collectives of the slowest stage
         + (p-1)/v t_stage                  pipeline bubble (1F1B, v interleaved chunks)
         + m v 2 t_p2p                      activations forward, gradients backward
         + exposed dp sync + optimizer      after overlap with the last backward
         + step sync                        loss, gradient norm, tied embedding all-reduces

where t_stage is one micro-batch through one stage, forward and backward, and m the
micro-batches per replica. With context parallelism each rank computes s/cp tokens:
its GEMMs and collectives shrink by cp, its attention core does 1/cp of 4 b s^2 h,
and per layer it passes the keys and values of its chunk around the ring of cp ranks
(cp - 1 sends forward, twice that backward with dK, dV), hidden behind the attention
core except for what the core cannot cover. Elementwise kernels (norms, activation, dropout, softmax,
residuals) are memory bound: they stream about twice the bytes they keep for backward.
Every op also costs the framework's dispatch time (`op_overhead`, counted per layer,
micro-batch and parameter tensor in `cost`): microseconds that matter on a CPU core.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tpkit.plan import cost
from tpkit.plan.activations import kv_heads_per_rank, layer_activation_bytes
from tpkit.plan.data_parallel import dp_time, optimizer_shards
from tpkit.plan.hardware import Hardware
from tpkit.plan.layout import Layout
from tpkit.plan.memory import (
    Precision,
    layout_stage_layers,
    memory_per_device,
    stage_params,
)
from tpkit.spec import theory
from tpkit.spec.config import ModelConfig
from tpkit.spec.grid import group_stride

__all__ = ["Cluster", "Estimate", "Layout", "evaluate", "layer_times", "tp_collectives"]


@dataclass(frozen=True)
class Cluster:
    """nodes x devices_per_node devices of one hardware profile."""

    hardware: Hardware
    nodes: int = 1
    devices_per_node: int | None = None  # None: the profile's
    usable_memory: float = 0.9  # share of device memory a run may use (context, fragmentation)
    overlap_dp: bool = True
    flash_attention: bool = True  # False: attention scores hit memory (pre-2022 Megatron)
    kernels: str | None = None  # whose kernels keep the activations; None: the profile's

    @property
    def activation_kernels(self) -> str:
        """`kernels`, or by default tpkit's own eager block on a CPU or calibrated `local`
        profile (which run tpkit itself) and Megatron-Core's fused kernels elsewhere
        (`plan.activations.KERNELS`)."""
        if self.kernels:
            return self.kernels
        return "eager" if self.hardware.name in ("cpu", "local") else "fused"

    @property
    def per_node(self) -> int:
        """Devices in one node."""
        return self.devices_per_node or self.hardware.devices_per_node

    @property
    def devices(self) -> int:
        """All devices."""
        return self.nodes * self.per_node

    @property
    def profile(self) -> Hardware:
        """The hardware profile with this cluster's devices per node.

        More devices than cores (CPU processes) time-share them: each gets cores/devices
        of a core (FLOP/s and bytes/s divided, dispatch time multiplied), and a collective
        step waits `shared_latency` for a peer that is not running: inside a node that is
        the step's latency, across nodes (hosts that share one machine's cores) the wait
        beyond the node's own latency comes on top of the network's.
        """
        hw = replace(self.hardware, devices_per_node=self.per_node)
        share = self.per_node / hw.cores_per_node if hw.cores_per_node else 1.0
        if share <= 1:
            return hw
        a = hw.accelerator
        acc = replace(a, peak_flops=a.peak_flops / share, mem_bandwidth=a.mem_bandwidth / share,
                      op_overhead=a.op_overhead * share)
        intra = replace(hw.intra, latency=hw.shared_latency or hw.intra.latency)
        wait = max(intra.latency - hw.intra.latency, 0.0)
        if wait:  # measured unshared: a scalar's step waits as the others do
            intra = replace(intra, scalar_latency=None)
        inter = replace(hw.inter, latency=hw.inter.latency + wait, scalar_latency=None
                        if hw.inter.scalar_latency is None else hw.inter.scalar_latency + wait)
        return replace(hw, accelerator=acc, intra=intra, inter=inter)


@dataclass
class Estimate:
    """Predicted cost of one layout: seconds per step by term, memory, throughput."""

    layout: Layout
    step_time_s: float
    terms: dict[str, float]  # seconds per step: compute, tp_comm, p2p, bubble, dp, optimizer
    per_layer: dict[str, float]  # seconds per layer and micro-batch, by kind
    memory: dict[str, float]  # bytes on the fullest device
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    hw_tflops_per_device: float  # counting recomputed FLOPs (how Megatron papers report)
    micro_batches: int
    fits: bool = True
    reason: str = ""
    notes: dict[str, float] = field(default_factory=dict)  # e.g. stage_imbalance


def layer_times(c: ModelConfig, seq: int, lay: Layout, hw: Hardware, prec: Precision,
                flash: bool = True) -> dict[str, float]:
    """Seconds for one layer and one micro-batch on one rank, by kind (forward and backward)."""
    acc, b, t, local = hw.accelerator, lay.micro_batch, lay.tp, seq // lay.cp
    share = c.tp_shares(t)  # of the largest rank: 1/tp unless tp leaves some a head more
    gemm = cost.gemm_time(cost.layer_forward_flops(c, b, local)["gemm"] * share["gemm"], acc,
                          min(b * local, c.hidden / t))
    attn = cost.gemm_time(cost.layer_forward_flops(c, b, seq)["attention"] * share["attention"]
                          / lay.cp, acc, c.head_dim)
    kept = layer_activation_bytes(c, seq, b, t, lay.sp, "none", prec.activation, flash,
                                  cp=lay.cp)  # what the elementwise kernels write and re-read
    elem = cost.memory_time(2 * kept, acc)
    ring = ring_attention_time(c, seq, lay, hw, prec)
    out = {"gemm_fwd": gemm, "attention_fwd": attn, "elementwise_fwd": elem,
           "gemm_bwd": 2 * gemm, "attention_bwd": 2 * attn, "elementwise_bwd": 2 * elem,
           "recompute": {"none": 0.0, "selective": attn, "full": gemm + attn + elem}[lay.recompute],
           "cp_ring_exposed": max(ring - attn, 0.0) + max(2 * ring - 2 * attn, 0.0),
           "overhead": cost.overhead_time(cost.OPS_PER_LAYER, acc)}
    out.update(tp_collectives(c, local, lay, hw, prec))
    return out


def layer_collectives(c: ModelConfig, seq: int, lay: Layout) -> list[theory.Expect]:
    """The tensor-parallel collectives of one layer and micro-batch, as the ledger records
    them: `spec.theory.layer` (2 all-reduces of b*s*h each way, or with SP 2 all-gathers
    + 2 reduce-scatters each way; a full recompute repeats the forward ones)."""
    return theory.layer(lay.micro_batch, seq, c.hidden, lay.tp, lay.sp, lay.recompute)


def collectives_time(expects: list[theory.Expect], elem_bytes: int, p: int, link) -> float:
    """Seconds of a list of collectives of `elem_bytes`-byte elements over p ranks."""
    return sum(e.count * cost.collective_time(e.op, e.numel * elem_bytes, p, link)
               for e in expects)


def ring_attention_time(c: ModelConfig, seq: int, lay: Layout, hw: Hardware,
                        prec: Precision) -> float:
    """Forward K/V ring of one layer: cp - 1 sends of this rank's k and v chunk."""
    if lay.cp == 1:
        return 0.0
    chunk = 2 * lay.micro_batch * seq // lay.cp * kv_heads_per_rank(c, lay.tp) * c.head_dim
    link = cost.link_for(lay.tp * lay.cp, hw, stride=group_stride("cp", lay.tp, lay.pp, lay.cp))
    return (lay.cp - 1) * cost.p2p_time(chunk * prec.activation, link)


def tp_collectives(c: ModelConfig, seq: int, lay: Layout, hw: Hardware,
                   prec: Precision) -> dict[str, float]:
    """Seconds of one layer's tensor-parallel collectives: the forward's, and the backward's
    (with a full recompute, the recomputed forward's collectives run during the backward)."""
    link = cost.link_for(lay.tp, hw)
    once = [e for e in layer_collectives(c, seq, replace(lay, recompute="none"))
            if e.phase == "forward"]
    fwd = collectives_time(once, prec.activation, lay.tp, link)
    total = collectives_time(layer_collectives(c, seq, lay), prec.activation, lay.tp, link)
    return {"tp_comm_fwd": fwd, "tp_comm_bwd": total - fwd}


def _stage_extras(c: ModelConfig, seq: int, lay: Layout, hw: Hardware, prec: Precision,
                  last: bool) -> tuple[float, float]:
    """(compute, comm) seconds of the embedding (first stage) or logits (last stage)."""
    acc, b, t = hw.accelerator, lay.micro_batch, lay.tp
    link = cost.link_for(t, hw)
    if not last:  # vocab-parallel embedding: one all-reduce (SP: reduce-scatter + all-gather)
        return 0.0, collectives_time(theory.embedding(b, seq, c.hidden, t, lay.sp),
                                     prec.activation, t, link)
    logits = cost.gemm_time(3 * cost.logits_forward_flops(c, b, seq) / t, acc,
                            min(b * seq, c.hidden))
    ce = collectives_time(theory.cross_entropy(b, seq, t), 4, t, link)  # fp32 max, target, sum
    logits += cost.overhead_time(cost.OPS_PER_MICRO_BATCH, acc)
    return logits, ce + collectives_time(theory.head(b, seq, c.hidden, t, lay.sp),
                                         prec.activation, t, link)


def evaluate(c: ModelConfig, seq: int, global_batch: int, lay: Layout, cluster: Cluster,
             prec: Precision | None = None) -> Estimate:
    """Predict step time, memory and throughput of one layout (no feasibility filtering)."""
    hw = cluster.profile
    prec = prec or Precision.for_dtype(hw.accelerator.dtype)
    m = global_batch // (lay.dp * lay.micro_batch)
    lt = layer_times(c, seq, lay, hw, prec, cluster.flash_attention)
    layer_compute = sum(v for k, v in lt.items() if not k.startswith("tp_comm"))
    layer_comm = lt["tp_comm_fwd"] + lt["tp_comm_bwd"]
    layers = layout_stage_layers(c.num_layers, lay)
    local = seq // lay.cp  # tokens per rank
    _, embed_comm = _stage_extras(c, local, lay, hw, prec, last=False)
    head_compute, head_comm = _stage_extras(c, local, lay, hw, prec, last=True)
    first = (layers[0] * layer_compute, layers[0] * layer_comm + embed_comm)
    last = (layers[-1] * layer_compute + head_compute, layers[-1] * layer_comm + head_comm)
    middle = [(n * layer_compute, n * layer_comm) for n in set(layers[1:-1])]
    stages = [first, last, *middle] if lay.pp > 1 else [(last[0], last[1] + embed_comm)]
    compute_mb, comm_mb = max(stages, key=lambda s: s[0] + s[1])
    t_stage = compute_mb + comm_mb
    terms = {"compute": m * compute_mb, "tp_comm": m * comm_mb,
             "bubble": theory.bubble_theory(lay.pp, m, lay.interleave) * m * t_stage,
             "p2p": _p2p_per_step(c, local, lay, hw, prec, m)}
    windows = [max(layers) * sum(lt[f"{k}_{d}"] for k in ("gemm", "attention", "elementwise"))
               for d in ("fwd", "bwd")]
    terms.update(_dp_and_optimizer(c, lay, cluster, hw, prec, m, *windows))
    terms["step_sync"] = _step_sync(c, lay, hw, prec)
    step = sum(terms.values())
    mem = memory_per_device(c, seq, lay, m, prec, cluster.flash_attention,
                            cluster.activation_kernels)
    e = _estimate(c, seq, global_batch, lay, cluster, step, terms, lt, mem, m)
    e.notes["stage_imbalance"] = max(sum(s) for s in stages) / min(sum(s) for s in stages) - 1
    e.notes["tp_imbalance"] = c.tp_shares(lay.tp)["attention"] * lay.tp - 1
    return e


def _p2p_per_step(c: ModelConfig, seq: int, lay: Layout, hw: Hardware, prec: Precision,
                  m: int) -> float:
    """Stage-to-stage sends on the critical path; scatter-gather sends 1/tp per rank."""
    if lay.pp == 1:
        return 0.0
    n = lay.micro_batch * seq * c.hidden * prec.activation / lay.tp
    link = cost.p2p_link(lay.tp * lay.pp, hw)
    return m * lay.interleave * 2 * cost.p2p_time(n, link)


def replica_link(lay: Layout, hw: Hardware):
    """The link of the dp x cp group that reduces gradients (`tpkit.spec.grid`: tp, cp,
    pp, dp from inside out; its nearest members are cp neighbours when cp > 1)."""
    nearest = "cp" if lay.cp > 1 else "dp"
    return cost.link_for(lay.devices, hw, stride=group_stride(nearest, lay.tp, lay.pp, lay.cp))


def _dp_and_optimizer(c: ModelConfig, lay: Layout, cluster: Cluster, hw: Hardware,
                      prec: Precision, m: int, fwd: float, bwd: float) -> dict[str, float]:
    params = max(stage_params(c, lay, s) for s in range(lay.pp))
    layer_count = max(layout_stage_layers(c.num_layers, lay))
    exposed = dp_time(params, layer_count, lay, replica_link(lay, hw), prec.grad, prec.weight,
                      m, fwd, bwd, cluster.overlap_dp)
    tensors = cost.param_tensors_per_layer(c) * layer_count + 4
    dispatch = cost.overhead_time(cost.OPS_PER_PARAM_TENSOR * tensors, hw.accelerator)
    shards = optimizer_shards(lay)
    return {"dp": exposed,
            "optimizer": cost.optimizer_time(params, shards, shards > 1, hw.accelerator)
            + dispatch}


def _step_sync(c: ModelConfig, lay: Layout, hw: Hardware, prec: Precision) -> float:
    """Once per step: the loss and the gradient norm (one float each over tp x pp, the loss
    again over dp) and, with pp > 1, the tied embedding's gradient between the end stages."""
    mp = lay.tp * lay.pp
    small = 2 * cost.scalar_all_reduce_time(mp, cost.link_for(mp, hw))
    small += cost.scalar_all_reduce_time(lay.replicas, replica_link(lay, hw))
    if lay.pp > 1 and c.tie_embeddings:
        small += cost.all_reduce_time(c.vocab_size * c.hidden / lay.tp * prec.grad, 2,
                                      cost.p2p_link(mp, hw))
    return small


def _estimate(c: ModelConfig, seq: int, global_batch: int, lay: Layout, cluster: Cluster,
              step: float, terms: dict, lt: dict, mem: dict, m: int) -> Estimate:
    tokens = global_batch * seq
    devices = lay.devices
    model_flops = cost.model_flops_per_token(c, seq) * tokens
    extra = {"none": 0.0, "selective": 1 / 3 * _attention_share(c, seq), "full": 1 / 3}
    hw_flops = model_flops * (1 + extra[lay.recompute])
    peak = cluster.hardware.accelerator.peak_flops
    fits = mem["total"] <= cluster.usable_memory * cluster.hardware.accelerator.memory_bytes
    return Estimate(layout=lay, step_time_s=step, terms=terms, per_layer=lt, memory=mem,
                    tokens_per_s=tokens / step,
                    tflops_per_device=model_flops / step / devices / 1e12,
                    mfu=model_flops / step / devices / peak,
                    hw_tflops_per_device=hw_flops / step / devices / 1e12,
                    micro_batches=m, fits=fits)


def _attention_share(c: ModelConfig, seq: int) -> float:
    """Share of a layer's forward FLOPs spent in the attention core (4 b s^2 h)."""
    f = cost.layer_forward_flops(c, 1, seq)
    return f["attention"] / (f["gemm"] + f["attention"])
