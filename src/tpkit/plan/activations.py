"""Activation memory of one layer, tensor by tensor: what the block saves for backward.

Instead of one constant for every model (GPT-3's 34 s b h bytes, Korthikanti et al.
2022, "Reducing Activation Recomputation", table 2), the bytes are summed over the
tensors a pre-norm block keeps, so SwiGLU's three matrices, GQA's smaller k and v and
RMSNorm come out of the shapes (s sequence, b micro-batch, h hidden, f MLP width,
a heads, g kv heads, d head dim, A bytes per activation element, t tensor-parallel):

    kept until backward               elements       sharded over
    norm inputs (2 norms)             2 s b h        t only with SP (replicated otherwise)
    norm outputs = qkv / fc1 inputs   2 s b h        t only with SP
    eager RMSNorm: x * rstd (2 norms) 2 s b h        t only with SP   (fused kernels: none)
    norm statistics (fp32)            2 or 4 s b     t only with SP   (RMS: rstd; LN: +mean)
    q                                 s b h          t
    k, v                              2 s b g d      t (g/t kv heads; a/t if k, v are repeated)
    attention output = out-proj input s b h          t
    flash log-sum-exp (fp32)          a s b          t
    no flash: softmax output          a s^2 b        t    (+ dropout mask, 1 byte, and the
                                                          dropped probabilities when p > 0)
    GeLU MLP: fc1 output, fc2 input   2 s b f        t
    SwiGLU: gate|up, silu(gate), fc2 input    eager 4 s b f, fused (Megatron) 3 s b f, over t
            xformers' fused op: gate|up only      2 s b f over t (its backward recomputes
                                                  the fc2 input, silu(gate) * up)
    dropout masks (p > 0, 1 byte)     2 s b h        t only with SP

For GPT with dropout and no flash this gives back Korthikanti's sbh(34 + 5as/h) bytes
(2-byte activations): 4 (norm inputs) + 4 (their outputs) + 6 (q, k, v) + 2 (attention
output) + 16 (MLP) + 2 (masks) = 34. `tests/test_activations.py` measures the saved
tensors of tpkit's real block (torch's saved-tensor hooks) against `kernels="eager"`.

Flash attention (the default) never stores the a s^2 b scores, whatever the recompute
mode. Selective recomputation (Megatron's core-attention recompute) drops the scores
when flash is off; full recomputation keeps only the layer input (s b h, over t with
SP). Context parallelism over cp ranks divides every s by cp. Where tp does not divide
s, "over t" means the largest rank's ceil(s/t) tokens (SP's split, `shapes.even_range`).
"""

from __future__ import annotations

from functools import lru_cache

from tpkit.spec import shapes
from tpkit.spec.config import ModelConfig
from tpkit.spec.theory import RECOMPUTE

FP32 = 4
MASK = 1  # a dropout mask is one byte per element
# Whose kernels run the block, which decides what it keeps for backward:
#   fused     Megatron-Core with Transformer Engine (fused norms and SwiGLU, native GQA)
#   eager     tpkit's own block in eager PyTorch (unfused RMSNorm and SwiGLU, k and v
#             repeated to every query head)
#   xformers  Meta's xformers SwiGLU (`xformers.ops.SwiGLU`, the fused op): it saves its
#             input and the two fc1 outputs only, and its backward (`silu_bw_fused`)
#             recomputes silu(gate) * up for fc2's weight gradient; the rest as fused
KERNELS = ("fused", "eager", "xformers")
SWIGLU_KEPT = {"fused": 3, "eager": 4, "xformers": 2}  # s b f/t tensors a SwiGLU MLP keeps


def kv_heads_per_rank(c: ModelConfig, tp: int) -> int:
    """kv heads the largest tp rank holds (split, shared, or one more where the query
    heads it holds straddle a kv group)."""
    return shapes.kv_heads_per_rank(c.num_heads, c.kv_heads, tp)


def saved_tensors(c: ModelConfig, s: int, b: int, tp: int = 1, sp: bool = False,
                  recompute: str = "none", act_bytes: int = 2, flash: bool = True,
                  kernels: str = "fused", cp: int = 1) -> dict[str, float]:
    """Bytes kept for backward by one layer and one micro-batch on one rank, by tensor.

    `kernels` (one of `KERNELS`) names whose kernels run the block: Megatron-Core's
    fused ones by default (Transformer Engine norms, fused SwiGLU, native GQA in flash
    attention), tpkit's own eager block, or xformers' fused SwiGLU (Meta's).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r} is not one of {KERNELS}")
    eager = kernels == "eager"
    s = s / cp
    # the residual stream is split over tp only with SP; the largest rank holds ceil(s/tp)
    # of the s tokens (`shapes.even_range`), s/outer
    outer = s / -(-s // tp) if sp else 1
    sbh = s * b * c.hidden
    if recompute == "full":
        return {"layer input": sbh * act_bytes / outer}
    out = _norm_terms(c, s, b, act_bytes, eager, outer)
    out.update(_attention_terms(c, s, b, tp, act_bytes, flash, eager,
                                drop_scores=recompute == "selective"))
    out.update(_mlp_terms(c, s, b, tp, act_bytes, kernels))
    if c.dropout > 0:
        out["dropout masks"] = 2 * sbh * MASK / outer
    return out


def _norm_terms(c: ModelConfig, s: float, b: int, act: int, eager: bool,
                outer: int) -> dict[str, float]:
    sbh = s * b * c.hidden
    rms = c.norm == "rmsnorm"
    out = {"norm inputs": 2 * sbh * act / outer,
           "norm outputs (qkv, fc1 inputs)": 2 * sbh * act / outer,
           "norm statistics": 2 * (1 if rms else 2) * s * b * FP32 / outer}
    if rms and eager:  # torch's eager rms_norm keeps x * rstd for the weight's gradient
        out["rmsnorm x*rstd"] = 2 * sbh * act / outer
    return out


def _attention_terms(c: ModelConfig, s: float, b: int, tp: int, act: int, flash: bool,
                     eager: bool, drop_scores: bool) -> dict[str, float]:
    heads, own_kv = shapes.heads_per_rank(c.num_heads, tp), kv_heads_per_rank(c, tp)
    kv = heads if eager else own_kv  # eager SDPA sees k, v repeated to every query head
    hd = c.head_dim
    out = {"q": s * b * heads * hd * act, "k, v": 2 * s * b * kv * hd * act,
           "attention output": s * b * heads * hd * act}
    if eager and own_kv < heads and c.position != "rope":  # q is a view of the qkv output,
        out["k, v before repeat"] = 2 * s * b * own_kv * hd * act  # which keeps them alive
    if flash:
        out["flash log-sum-exp"] = heads * s * b * FP32
    elif not drop_scores:
        scores = heads * s * s * b
        out["softmax output"] = scores * act
        if c.dropout > 0:
            out["attention dropout"] = scores * (MASK + act)
    return out


def _mlp_terms(c: ModelConfig, s: float, b: int, tp: int, act: int,
               kernels: str) -> dict[str, float]:
    sbf = s * b * -(-c.ffn // tp) * act  # the largest rank's columns
    if c.activation == "swiglu":
        return {"MLP (gate|up, silu, fc2 input)": SWIGLU_KEPT[kernels] * sbf}
    return {"MLP (fc1 output, fc2 input)": 2 * sbf}


@lru_cache(maxsize=4096)  # the planner prices 10^4 layouts, few distinct layers among them
def layer_activation_bytes(c: ModelConfig, s: int, b: int, tp: int = 1, sp: bool = False,
                           recompute: str = "none", act_bytes: int = 2, flash: bool = True,
                           kernels: str = "fused", cp: int = 1) -> float:
    """The sum of `saved_tensors`: bytes of one layer and one micro-batch on one rank."""
    return sum(saved_tensors(c, s, b, tp, sp, recompute, act_bytes, flash, kernels,
                             cp).values())
