"""Cost model: FLOPs to seconds, bytes to seconds. Pure Python, one formula per function.

Collectives, alpha-beta model of a ring over p ranks (Thakur et al. 2005; NCCL's
bus-bandwidth convention), n bytes per rank, alpha latency per step, B bus bandwidth:

    all-reduce                  2(p-1) alpha + 2(p-1)/p * n/B
    all-gather, reduce-scatter   (p-1) alpha +  (p-1)/p * n/B     (n = the full tensor)
    point-to-point                     alpha +            n/B

On a link measured as overlapped (`Link.overlap`: `tpkit calibrate` found its steps fit
max(alpha, wire time) better than the sum), each ring step costs the longer of alpha and
its chunk's wire time: the bytes travel while the peer is still being woken, as over
TCP between hosts whose alpha is mostly the time to schedule a process, not the wire.

A group runs on the intra-node link when all its ranks share a node, else on the
inter-node link. Compute (Narayanan et al. 2021, appendix; Megatron counting):

    forward of one layer      2 b s P_matmul + 4 b s^2 h    (= 24 b s h^2 + 4 b s^2 h for
                                                             GPT with ffn = 4h)
    backward                  twice the forward; full recompute adds one forward
    logits                    2 b s h V forward

Pipeline bubble of 1F1B: (p-1)/m of the ideal time; interleaved with v chunks per
device: (p-1)/(v m) (Narayanan et al. 2021, sections 2.2.1-2.2.2).
"""

from __future__ import annotations

from dataclasses import replace

from tpkit.plan.hardware import Accelerator, Hardware, Link
from tpkit.spec.config import ModelConfig
from tpkit.spec.grid import group_fits_node
from tpkit.spec.theory import ring_factor, ring_steps


# -- collectives -----------------------------------------------------------------------------
def step_time(nbytes: float, link: Link) -> float:
    """One step that moves `nbytes` over `link`: a + n/B, or max(a, n/B) where the link
    overlaps its latency with the transfer (`Link.overlap`)."""
    wire = nbytes / link.bandwidth
    return max(link.latency, wire) if link.overlap else link.latency + wire


def collective_time(op: str, nbytes: float, p: int, link: Link) -> float:
    """Ring `op` of `nbytes` per rank over p ranks: steps a + factor n/B, with the steps
    and wire factor of `spec.theory` (2(p-1) and 2(p-1)/p for an all-reduce); each step
    moves factor n / steps bytes (n/p), priced by `step_time`."""
    steps = ring_steps(op, p)
    return steps * step_time(ring_factor(op, p) * nbytes / steps, link) if steps else 0.0


def all_reduce_time(nbytes: float, p: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` per rank over p ranks: 2(p-1)a + 2(p-1)/p n/B."""
    return collective_time("all_reduce", nbytes, p, link)


def scalar_all_reduce_time(p: int, link: Link) -> float:
    """All-reduce of a few bytes over p ranks: 2(p-1) steps of the link's latency at that
    size (`Link.scalar_latency`, measured by `tpkit calibrate`; else its alpha)."""
    latency = link.latency if link.scalar_latency is None else link.scalar_latency
    return ring_steps("all_reduce", p) * latency


def all_gather_time(nbytes: float, p: int, link: Link) -> float:
    """Ring all-gather producing `nbytes` per rank: (p-1)a + (p-1)/p n/B."""
    return collective_time("all_gather", nbytes, p, link)


def reduce_scatter_time(nbytes: float, p: int, link: Link) -> float:
    """Ring reduce-scatter of `nbytes` per rank: (p-1)a + (p-1)/p n/B (same as all-gather)."""
    return all_gather_time(nbytes, p, link)


def p2p_time(nbytes: float, link: Link) -> float:
    """One send/recv of `nbytes`: a + n/B (one `step_time`)."""
    return step_time(nbytes, link)


def link_for(span: int, hw: Hardware, stride: int = 1) -> Link:
    """The link a group runs on: `span` consecutive ranks, of which every `stride`-th is in it.

    Inside a node: the intra-node link. Across nodes, a ring crosses each node boundary
    through NICs, and NCCL spreads its channels over the NICs of the group's ranks: a
    group with k ranks per node gets k NICs (each GPU owns one on DGX/HGX), at most the
    intra-node rate. So a tp group that fills whole nodes uses all their NICs, while
    the dp groups, one rank per node each, get one NIC apiece. Where a node has fewer
    NICs than devices (`nics_per_node`: hosts with one network port), the groups that
    run at once share them: each of k ranks per node gets nics/devices of a port.
    """
    per_node = hw.devices_per_node
    if group_fits_node(span, per_node):
        return hw.intra
    k = max(1, min(span, per_node) // stride)
    ports = k * nic_share(hw)
    bandwidth = min(hw.intra.bandwidth, ports * hw.inter.bandwidth)
    name = hw.inter.name + (f" x{ports:g} NICs" if ports != 1 else "")
    return replace(hw.inter, name=name, bandwidth=bandwidth)


def nic_share(hw: Hardware) -> float:
    """Network ports per device: 1 on DGX/HGX, less where the devices share a port."""
    nics = hw.nics_per_node or hw.devices_per_node
    return min(1.0, nics / hw.devices_per_node)


def p2p_link(span: int, hw: Hardware) -> Link:
    """Stage-to-stage sends: each rank sends its own 1/tp share through its NIC (its share
    of one, where a node's devices share ports)."""
    if group_fits_node(span, hw.devices_per_node):
        return hw.intra
    share = nic_share(hw)
    return hw.inter if share == 1 else replace(hw.inter, bandwidth=share * hw.inter.bandwidth)


# -- compute ---------------------------------------------------------------------------------
def matmul_params(c: ModelConfig) -> int:
    """Weights of one layer that take part in a matmul (qkv, out, MLP), no biases or norms."""
    h, hd = c.hidden, c.head_dim
    attn = h * (c.num_heads + 2 * c.kv_heads) * hd + c.num_heads * hd * h
    mlp = (3 if c.activation == "swiglu" else 2) * h * c.ffn
    return attn + mlp


def layer_forward_flops(c: ModelConfig, b: int, s: int) -> dict[str, float]:
    """Forward FLOPs of one layer and micro-batch: {'gemm': 2bsP, 'attention': 4bs^2h}."""
    return {"gemm": 2.0 * b * s * matmul_params(c), "attention": 4.0 * b * s * s * c.hidden}


def logits_forward_flops(c: ModelConfig, b: int, s: int) -> float:
    """Forward FLOPs of the output projection: 2 b s h V."""
    return 2.0 * b * s * c.hidden * c.vocab_size


def model_flops_per_token(c: ModelConfig, s: int) -> float:
    """Training FLOPs per token without recomputation: 3 x forward (MFU's numerator)."""
    layer = layer_forward_flops(c, 1, s)
    fwd = c.num_layers * (layer["gemm"] + layer["attention"]) + logits_forward_flops(c, 1, s)
    return 3 * fwd / s


def gemm_efficiency(acc: Accelerator, smallest_dim: float) -> float:
    """Fraction of peak a GEMM reaches when its smallest side is d: eff * d / (d + d_half).

    A modelling assumption, not a measured law: small sides lower the arithmetic
    intensity and tile occupancy (NVIDIA, "Matrix Multiplication Background" guide);
    `tpkit calibrate` fits eff and d_half on this machine.
    """
    return acc.gemm_efficiency * smallest_dim / (smallest_dim + acc.gemm_half_dim)


def gemm_time(flops: float, acc: Accelerator, smallest_dim: float) -> float:
    """Seconds for `flops` of GEMM whose smallest side is `smallest_dim`."""
    return flops / (acc.peak_flops * gemm_efficiency(acc, smallest_dim))


def memory_time(nbytes: float, acc: Accelerator) -> float:
    """Seconds to stream `nbytes` through device memory (elementwise kernels)."""
    return nbytes / acc.mem_bandwidth


# -- framework overhead (eager PyTorch) ------------------------------------------------------
# Ops dispatched in one step of `tpkit.train.loop.train` on a GPT model, counted with a
# TorchDispatchMode around the step (hidden 16, 1-4 layers, 1-4 micro-batches m, T
# parameter tensors): N = 16 + m (85 + 102 L) + 18 T, within 0.2% of every count.
# Each op costs `op_overhead` (dispatch + autograd) besides its FLOPs and bytes: on a
# CPU core a few microseconds, which is what a model of hidden 64 spends most time on.
OPS_PER_LAYER = 102  # one layer, forward + backward, one micro-batch
OPS_PER_MICRO_BATCH = 85  # embedding, final norm, logits, loss, schedule bookkeeping
OPS_PER_PARAM_TENSOR = 18  # AdamW (foreach), gradient norm, clipping, zero_grad


def param_tensors_per_layer(c: ModelConfig) -> int:
    """Parameter tensors of one layer: 2 norms, qkv, out and 2 (swiglu: 3) MLP matrices."""
    norms = 2 * (2 if c.norm == "layernorm" else 1)
    linears = 4 + (1 if c.activation == "swiglu" else 0)
    return norms + linears * (2 if c.bias else 1)


def overhead_time(ops: float, acc: Accelerator) -> float:
    """Seconds of framework dispatch for `ops` ops."""
    return ops * acc.op_overhead


# -- pipeline and optimizer (data parallel: data_parallel.py) ------------------------------------------------------------
def optimizer_time(params: int, shards: int, sharded: bool, acc: Accelerator,
                   bytes_per_param: int = 28) -> float:
    """Adam step, memory bound: reads grad, master, m, v and writes them and the weights;
    with a sharded optimizer each of `shards` ranks updates 1/shards of them."""
    return memory_time(params / (shards if sharded else 1) * bytes_per_param, acc)
