"""Memory per device: parameters per rank, weights + gradients + optimizer, activations.

Parameters per rank (how tpkit splits a model, Megatron style):

    column-parallel  qkv, fc1 (and gate):  [h, out/tp]  + bias out/tp      sharded
    row-parallel     attn-out, fc2:        [in/tp, h]   + bias h           bias replicated
    vocab-parallel   embedding (+ untied head): [V_pad/tp, h]              sharded
    norms, position / token-type embeddings                                replicated

Pipeline stages get consecutive layers (`spec.shapes.layers_per_stage`); stage 0 holds
the embeddings, the last stage the final norm and the output head (a copy of the tied embedding when
pp > 1, as Megatron keeps one for the logits).

Model state (ZeRO paper, Rajbhandari et al. 2020, section 3.1): mixed-precision Adam
keeps 2 + 2 + 12 bytes per parameter (bf16 weights and grads; fp32 master, m, v);
ZeRO-1 divides the 12 optimizer bytes by dp. Activations per layer and micro-batch,
Korthikanti et al. 2022 ("Reducing Activation Recomputation", table 2), in bytes with
16-bit activations (s sequence, b micro-batch, h hidden, a heads, t tensor-parallel):

    no parallelism           sbh (34 + 5as/h)
    tensor parallel          sbh (10 + 24/t + 5as/(ht))
    + sequence parallel      sbh (34/t + 5as/(ht))
    selective recompute      the 5as/(ht) term goes (attention scores recomputed /
                             flash attention)
    full recompute           2sbh (the layer input only; /t with sequence parallelism)
"""

from __future__ import annotations

from dataclasses import dataclass

from tpkit.spec.config import ModelConfig
from tpkit.spec.shapes import layers_per_stage
from tpkit.spec.theory import RECOMPUTE


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of model state, and per activation element."""

    weight: int = 2
    grad: int = 2
    optimizer: int = 12  # fp32 master + Adam m + v
    activation: int = 2

    @classmethod
    def for_dtype(cls, dtype: str) -> Precision:
        """bf16/fp16 mixed precision (2, 2, 12), or plain fp32 training (4, 4, 8)."""
        return cls(4, 4, 8, 4) if dtype == "fp32" else cls()


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


def model_state_bytes(params: int, dp: int, zero1: bool, prec: Precision) -> dict[str, float]:
    """Weights, gradients and optimizer state of `params` parameters on one rank."""
    opt = prec.optimizer * params / (dp if zero1 else 1)
    return {"weights": prec.weight * params, "grads": prec.grad * params, "optimizer": opt}


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, tp: int, sp: bool,
                               recompute: str, act_bytes: int = 2) -> float:
    """Korthikanti et al. 2022 activations of one layer and one micro-batch, in bytes."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")
    sbh = s * b * h * act_bytes / 2  # the paper's constants assume 2-byte activations
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    attn = 0.0 if recompute == "selective" else 5 * a * s / (h * tp)
    base = 34 / tp if sp else 10 + 24 / tp
    return sbh * (base + attn)


def in_flight_micro_batches(pp: int, stage: int, m: int, interleave: int = 1) -> float:
    """Micro-batches whose activations stage `stage` holds at the 1F1B peak.

    Stage i of p holds min(p - i, m) micro-batches; the interleaved schedule adds
    (p - 1)/(p v) of a stage's worth on the first stage (Narayanan et al. 2021, sec. 2.2.2).
    """
    held = min(pp - stage, m)
    if interleave > 1 and pp > 1:
        held *= 1 + (pp - 1) / (pp * interleave)
    return held


def stage_activation_bytes(c: ModelConfig, seq: int, micro_batch: int, tp: int, pp: int,
                           stage: int, m: int, sp: bool, recompute: str, interleave: int = 1,
                           act_bytes: int = 2) -> float:
    """Activation bytes of one rank of `stage` at the schedule's peak (+ logits on the last)."""
    per_layer = activation_bytes_per_layer(seq, micro_batch, c.hidden, c.num_heads, tp, sp,
                                           recompute, act_bytes)
    layers = layers_per_stage(c.num_layers, pp)[stage]
    total = per_layer * layers * in_flight_micro_batches(pp, stage, m, interleave)
    if stage == pp - 1:  # fp32 logits of one micro-batch, vocab-parallel (Korthikanti eq. 3)
        total += 4 * seq * micro_batch * c.padded_vocab(tp) / tp
    return total


def memory_per_device(c: ModelConfig, seq: int, micro_batch: int, tp: int, pp: int, dp: int,
                      m: int, sp: bool, recompute: str, zero1: bool, prec: Precision,
                      interleave: int = 1) -> dict[str, float]:
    """Peak bytes of the fullest rank, as {weights, grads, optimizer, activations, total}."""
    worst: dict[str, float] = {}
    for stage in sorted({0, pp - 1}):  # the first stage holds most; the last, the logits
        parts = model_state_bytes(params_per_rank(c, tp, pp, stage), dp, zero1, prec)
        parts["activations"] = stage_activation_bytes(c, seq, micro_batch, tp, pp, stage, m, sp,
                                                      recompute, interleave, prec.activation)
        parts["total"] = sum(parts.values())
        if parts["total"] > worst.get("total", -1.0):
            worst = parts
    return worst
