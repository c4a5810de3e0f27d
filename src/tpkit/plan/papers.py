"""Published runs the planner is checked against: model shapes, layouts and measured results.

Shoeybi et al. 2019, "Megatron-LM" (arXiv:1909.08053): table 1 models, GPT-2 style,
vocab 51,200, sequence 1024, activation checkpointing after every layer, DGX-2H
(16 V100 per node). Weak scaling at batch 8 per model replica (figure 5 and sec. 5.1:
8-way model parallel reaches 77% of linear scaling); 512 GPUs (64-way data parallel,
global batch 512) sustain 15.1 PFLOP/s, 76% of the 39 TFLOP/s single-GPU baseline.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (arXiv:2104.04473): table 1 (weak scaling to 1T parameters on
Selene, DGX A100 80 GB, vocab 51,200, sequence 2048; layouts from the authors'
examples/sc21/run_table_1.sh) and figure 13 (162.2B = 32 layers, h=20480, 128 heads on
64 GPUs, micro-batch 1, full recompute; examples/sc21/run_figure_13.sh). Their
TFLOP/s count recomputation (96 B s l h^2 (...)): compare with `hw_tflops_per_device`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpkit.spec.config import ModelConfig


def gpt(name: str, hidden: int, layers: int, heads: int, seq: int) -> ModelConfig:
    """A Megatron GPT: learned positions, LayerNorm, GeLU, biases, tied embeddings, and
    Megatron-LM's default dropout of 0.1 (hidden and attention), which these runs kept."""
    return ModelConfig(name=name, vocab_size=51200, hidden=hidden, num_layers=layers,
                       num_heads=heads, max_seq_len=seq, dropout=0.1)


@dataclass(frozen=True)
class Published:
    """One published measurement: model, layout, cluster and what was achieved."""

    config: ModelConfig
    seq: int
    global_batch: int
    tp: int
    pp: int
    dp: int
    micro_batch: int
    interleave: int
    hardware: str
    per_node: int
    tflops_per_gpu: float  # as the paper counts them (with recomputation for Narayanan)
    source: str


# Shoeybi et al. 2019, table 1 models (hidden, layers, heads); model-parallel GPUs 1, 2, 4, 8.
SHOEYBI_2019 = [gpt("megatron-1.2b", 1536, 40, 16, 1024), gpt("megatron-2.5b", 1920, 54, 20, 1024),
                gpt("megatron-4.2b", 2304, 64, 24, 1024), gpt("megatron-8.3b", 3072, 72, 32, 1024)]
# Weak-scaling efficiency at 1, 2, 4, 8-way model parallelism (figure 5; 77% quoted in 5.1).
SHOEYBI_MP_EFFICIENCY = {1: 1.00, 2: 0.95, 4: 0.82, 8: 0.77}
SHOEYBI_BASELINE_TFLOPS = 39.0  # 1.2B on one V100 ("30% of peak")
SHOEYBI_512_PFLOPS = 15.1  # 8.3B, 8-way model x 64-way data parallel (76% scaling)

# Narayanan et al. 2021, table 1 rows: (name, heads, hidden, layers, tp, pp, GPUs, batch,
# micro-batch, virtual stages per device, achieved TFLOP/s per GPU).
_TABLE1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
]


def narayanan_table1() -> list[Published]:
    """Narayanan et al. 2021 table 1 as Published rows (A100 80 GB, 8 per node)."""
    out = []
    for name, heads, h, layers, tp, pp, gpus, gbs, mb, v, tf in _TABLE1:
        cfg = gpt(f"megatron-{name}", h, layers, heads, 2048)
        out.append(Published(cfg, 2048, gbs, tp, pp, gpus // (tp * pp), mb, v, "a100-80gb", 8,
                             tf, "Narayanan et al. 2021, table 1"))
    return out


NARAYANAN_162B = gpt("megatron-162b", 20480, 32, 128, 2048)
# Figure 13 is a plot; these are approximate readings of its peaks at (tp=8, pp=8), in
# TFLOP/s per GPU, batch 128 and 32 (read to about +-10 TFLOP/s).
NARAYANAN_FIG13_PEAK = {128: 165.0, 32: 142.0}
FIG13_LAYOUTS = [(32, 2), (16, 4), (8, 8), (4, 16), (2, 32)]  # (tp, pp) on 64 GPUs


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
# (arXiv:2205.05198): table 3 (models and layouts; A100 80 GB, sequence 2048, vocab
# 51,200, dp = 1, 3 interleaved stages for 175B and 530B) and table 5 (seconds per
# iteration with full recomputation, and with sequence parallelism + selective
# recomputation, whose model FLOPs utilisation it reports; the Megatron-LM README
# prints the same MFU). Rows: (name, heads, hidden, layers, tp, pp, GPUs, batch,
# micro-batch, interleave, full-recompute s, SP + selective s, MFU).
KORTHIKANTI_TABLE5 = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10, 0.415),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75, 0.514),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83, 0.560),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49, 0.563),
]

# Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783), table 4: Llama 3
# 405B (GQA, SwiGLU) on H100 80 GB, 16M tokens per batch, BF16, no activation
# checkpointing at 8K; 8 GPUs per server on a RoCE fabric (400 Gb/s per GPU). Rows:
# (GPUs, tp, cp, pp, dp, sequence, sequences per batch, TFLOP/s per GPU, BF16 MFU).
# Section 3.3.2 runs FSDP "without resharding after forward" and an interleaved schedule
# whose degree V it does not give; but it takes one layer off the first and last stages
# so that "the first model chunk on the first stage has only the embedding": a chunk
# holds one layer, so V = (126 + 2) / 16 = 8 chunks per rank (inferred, not stated).
LLAMA3_INTERLEAVE = 8
# Nor does it name its kernels. Meta's stack is priced with Meta's own fused SwiGLU
# (xformers.ops.SwiGLU, "fused"), which keeps the two fc1 outputs and recomputes
# silu(gate) * up in its backward: the policy of the Llama paper (Touvron et al. 2023,
# sec. 2.4: "we save the activations that are expensive to compute, such as the outputs
# of linear layers ... by manually implementing the backward function"). Megatron-Core's
# fused SwiGLU keeps that product too: 533 MB a layer instead of 424 at tp 8, seq 8192
# (inferred, not stated; `activations.KERNELS`).
LLAMA3_KERNELS = "xformers"
LLAMA3_TABLE4 = [
    (8192, 8, 1, 16, 64, 8192, 2048, 430, 0.43),
    (16384, 8, 1, 16, 128, 8192, 2048, 400, 0.41),
    (16384, 8, 16, 16, 8, 131072, 128, 380, 0.38),
]
