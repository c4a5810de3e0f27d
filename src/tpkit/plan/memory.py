"""Memory per device: parameters per rank, weights + gradients + optimizer, activations.

Parameters per rank (how tpkit splits a model, Megatron style):

    column-parallel  qkv, fc1 (and gate):  [h, out/tp]  + bias out/tp      sharded
    row-parallel     attn-out, fc2:        [in/tp, h]   + bias h           bias replicated
    vocab-parallel   embedding (+ untied head): [V_pad/tp, h]              sharded
    norms, position / token-type embeddings                                replicated

Pipeline stages get consecutive layers (`spec.shapes.layers_per_stage`); stage 0 holds
the embeddings, the last stage the final norm and the output head (a copy of the tied embedding when
pp > 1, as Megatron keeps one for the logits).

Model state per parameter (Megatron-LM's distributed-optimizer guide; ZeRO paper,
Rajbhandari et al. 2020, section 3.1), with N = dp x cp ranks sharing the weights:

                        weights       gradients          optimizer (fp32 master, m, v)
    plain data parallel   2           4 (fp32 main)      12
    ZeRO-1                2           4                  12/N       (Megatron: 6 + 12/N)
    ZeRO-2                2           4/N                12/N
    FSDP (ZeRO-3)         2/N         4/N                12/N       + the full weights of
                                                         the layers being computed (2 layers:
                                                         the current one and the prefetched
                                                         next) and one layer's full gradients
    FSDP, after-step      2/N + 2     4                  12/N       the stage's weights, gathered
                                                         once and kept, and its gradients,
                                                         accumulated unsharded, for the step
                                                         (one micro-batch: its backward
                                                         reduce-scatters layer by layer, so
                                                         one layer's full gradients, as
                                                         after-forward)

Gradients are fp32 by default, as Megatron-Core keeps them with bf16 training (main
gradients accumulated and reduced in fp32); `Precision(grad=2)` is bf16 gradients.

Activations: `activations.py`, tensor by tensor, times the micro-batches in flight;
`kernels` says whose kernels keep them (`activations.KERNELS`: Megatron-Core's fused
ones by default; "eager", tpkit's own block on a CPU or `local` profile; "xformers",
Meta's fused SwiGLU, which keeps one s b f/t tensor fewer).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tpkit.plan.activations import layer_activation_bytes
from tpkit.plan.layout import Layout
from tpkit.spec import theory
from tpkit.spec.config import ModelConfig
from tpkit.spec.shapes import layers_per_stage

GRAD_DTYPES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of model state, and per activation element.

    The default is Megatron-Core's bf16 training: bf16 weights, fp32 main gradients,
    fp32 master weights + Adam m + v.
    """

    weight: int = 2
    grad: int = 4
    optimizer: int = 12  # fp32 master + Adam m + v
    activation: int = 2

    @classmethod
    def for_dtype(cls, dtype: str, grad: str = "fp32") -> Precision:
        """Mixed precision (2, 4 or 2 by `grad`, 12), or plain fp32 training (4, 4, 8)."""
        if grad not in GRAD_DTYPES:
            raise ValueError(f"gradient dtype {grad!r} is not one of {tuple(GRAD_DTYPES)}")
        return cls(4, 4, 8, 4) if dtype == "fp32" else cls(grad=GRAD_DTYPES[grad])


def layout_stage_layers(num_layers: int, lay: Layout) -> list[int]:
    """Layers per stage of a plan: `spec.shapes.layers_per_stage`, or with `lighter_ends` one fewer than the
    middle stages on the first and last (which must then split the rest evenly)."""
    if not lay.lighter_ends:
        return layers_per_stage(num_layers, lay.pp)
    ends = lighter_end_layers(num_layers, lay.pp)
    if ends is None:
        raise ValueError(f"num_layers={num_layers} over pp={lay.pp}: no split with one layer "
                         f"fewer on the first and last stages")
    middle = (num_layers - 2 * ends) // (lay.pp - 2)
    return [ends] + [middle] * (lay.pp - 2) + [ends]


def lighter_end_layers(num_layers: int, pp: int) -> int | None:
    """Layers of the first and last stage when they take one fewer than the even middle
    stages (126 over 16: 7, 8 x 14, 7), or None when no such split exists."""
    if pp <= 2:
        return None
    middle, rest = divmod(num_layers + 2, pp)
    return middle - 1 if rest == 0 and middle > 1 else None


def chunks_split_evenly(num_layers: int, pp: int, interleave: int, lighter_ends: bool) -> bool:
    """Whether `interleave` chunks per stage get equal layers: num_layers/(pp v) each, or
    with lighter ends (num_layers + 2)/(pp v), the embedding and the loss counted as a
    layer each (Llama 3's schedule; Megatron --account-for-{embedding,loss}-in-pipeline-split):
    126 layers over pp 16, v 8 gives 1 a chunk and an embedding-only first chunk."""
    return interleave == 1 or (num_layers + 2 * lighter_ends) % (pp * interleave) == 0


def params_per_rank(config: ModelConfig, tp: int, pp: int, stage: int) -> int:
    """Parameters held by one rank of pipeline stage `stage` at (tp, pp)."""
    c = config
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} is outside 0..{pp - 1} for pp={pp}")
    n = layers_per_stage(c.num_layers, pp)[stage] * c.layer_params(tp)
    vocab_shard = c.padded_vocab(tp) // tp * c.hidden
    if stage == 0:
        n += vocab_shard + c.type_vocab_size * c.hidden + (c.norm_params() if c.embed_norm else 0)
        n += c.max_seq_len * c.hidden if c.position == "learned" else 0
    if stage == pp - 1:
        n += c.norm_params() if c.pre_norm else 0
        if not c.tie_embeddings or pp > 1:
            n += vocab_shard
    return n


def model_state_bytes(params: int, replicas: int, zero: int, prec: Precision,
                      layer_params: int = 0, keep_gathered: bool = False,
                      micro_batches: int = 2) -> dict[str, float]:
    """Weights, gradients and optimizer state of `params` parameters on one rank.

    `replicas` ranks (dp x cp) share the state as `zero` says (0, 1, 2 or 3 = FSDP);
    FSDP also holds `layer_params` gathered weights for 2 layers and gradients for one,
    or with `keep_gathered` (after-step) all `params` gathered weights and, when gradients
    accumulate over `micro_batches` > 1, all `params` unsharded gradients (the shards
    replace them unit by unit in the last backward: at the peak one unit's shard exists
    beside them, measured by `benchmarks/memory_sharded.py`).
    """
    n = replicas
    gathered = params if keep_gathered else 2 * layer_params
    weights = prec.weight * (params / n + gathered if zero >= 3 else params)
    grads = prec.grad * (params / n + layer_params if zero >= 2 else params)
    if zero >= 3 and keep_gathered and micro_batches > 1:  # the shards are made only as the
        grads = prec.grad * (params + layer_params / n)  # last backward frees the full ones
    return {"weights": weights, "grads": grads,
            "optimizer": prec.optimizer * params / (n if zero >= 1 else 1)}


def chunk_layers(num_layers: int, lay: Layout, stage: int) -> tuple[int, ...]:
    """Layers of each of `stage`'s chunks: the stage's layers split evenly over its
    `interleave` chunks; with lighter ends, (num_layers + 2)/(pp v) each, less one on the
    first chunk of the first stage (its embedding) and the last chunk of the last (its
    output): Llama 3's 126 layers over pp 16, v 8 give (0, 1, ..., 1) on stage 0."""
    layers, v = layout_stage_layers(num_layers, lay)[stage], lay.interleave
    if lay.lighter_ends and v > 1:
        out = [(num_layers + 2) // (lay.pp * v)] * v
        out[0] -= stage == 0
        out[-1] -= stage == lay.pp - 1
        return tuple(out)
    return (layers // v,) * v if layers % v == 0 else (layers,)


def layers_in_flight(num_layers: int, lay: Layout, stage: int, m: int) -> float:
    """Layer-micro-batches whose activations stage `stage` holds at the schedule's peak:
    its layers x the chunk forwards in flight / v (`spec.theory.peak_in_flight`; 1F1B:
    min(p - i, m); interleaved, the warm-up 2(p - i - 1) + (v - 1)p + 1, at most m v);
    chunks of unequal layers (lighter ends) by walking the schedule's order
    (`spec.theory.peak_layers_in_flight`)."""
    chunks = chunk_layers(num_layers, lay, stage)
    if len(set(chunks)) > 1:  # an embedding-only or output-only chunk: walk the order
        return theory.peak_layers_in_flight(stage, lay.pp, chunks, m)
    return sum(chunks) * theory.peak_in_flight(stage, lay.pp, lay.interleave, m) \
        / lay.interleave


def stage_activation_bytes(c: ModelConfig, seq: int, lay: Layout, stage: int, m: int,
                           act_bytes: int = 2, flash: bool = True,
                           kernels: str = "fused") -> float:
    """Activation bytes of one rank of `stage` at the schedule's peak (+ logits on the last)."""
    tp, pp = lay.tp, lay.pp
    per_layer = layer_activation_bytes(c, seq, lay.micro_batch, tp, lay.sp, lay.recompute,
                                       act_bytes, flash, kernels, cp=lay.cp)
    total = per_layer * layers_in_flight(c.num_layers, lay, stage, m)
    if stage == pp - 1:  # fp32 logits of one micro-batch, vocab-parallel (Korthikanti eq. 3)
        total += 4 * seq / lay.cp * lay.micro_batch * c.padded_vocab(tp) / tp
    return total


def memory_per_device(c: ModelConfig, seq: int, lay: Layout, m: int, prec: Precision,
                      flash: bool = True, kernels: str = "fused") -> dict[str, float]:
    """Peak bytes of the fullest rank, as {weights, grads, optimizer, activations, total}."""
    return max(memory_per_stage(c, seq, lay, m, prec, flash, kernels),
               key=lambda p: p["total"])


def memory_per_stage(c: ModelConfig, seq: int, lay: Layout, m: int, prec: Precision,
                     flash: bool = True, kernels: str = "fused") -> list[dict[str, float]]:
    """Peak bytes of one rank of each pipeline stage (every tp and dp rank of a stage
    holds the same), as {weights, grads, optimizer, activations, total}."""
    out = []
    for stage in range(lay.pp):  # 1F1B: stage i holds p - i micro-batches of its layers
        parts = model_state_bytes(stage_params(c, lay, stage), lay.replicas, lay.zero, prec,
                                  c.layer_params(lay.tp), lay.keeps_gathered_weights, m)
        parts["activations"] = stage_activation_bytes(c, seq, lay, stage, m, prec.activation,
                                                      flash, kernels)
        parts["total"] = sum(parts.values())
        out.append(parts)
    return out


def stage_params(c: ModelConfig, lay: Layout, stage: int) -> int:
    """`params_per_rank` of `stage` with the plan's layers per stage."""
    return _stage_params(c, lay.tp, lay.pp, lay.lighter_ends, stage)


@lru_cache(maxsize=8192)  # the planner asks for every stage of 10^4 layouts: few distinct
def _stage_params(c: ModelConfig, tp: int, pp: int, lighter_ends: bool, stage: int) -> int:
    even = layers_per_stage(c.num_layers, pp)[stage]
    moved = layout_stage_layers(c.num_layers, Layout(tp, pp, 1, 1, lighter_ends=lighter_ends))[
        stage] - even
    return params_per_rank(c, tp, pp, stage) + moved * c.layer_params(tp)
