"""The chosen plan as command lines a user can paste: `tpkit train` and Megatron-LM flags.

    torchrun --nnodes 8 --nproc_per_node 8 --node_rank $NODE_RANK \\
      --master_addr $MASTER_ADDR --master_port 29500 -m tpkit train --preset llama3-70b \\
      --tp 8 --pp 4 --dp 2 --sp --zero1 --micro-batches 64 --global-batch 128 --seq 4096 ...

tpkit runs tp, pp, dp, context parallelism, sequence parallelism, ZeRO-1, ZeRO-2,
FSDP (both reshard modes), interleaving and full recomputation; `tpkit_gaps` names
what a plan needs beyond that (lighter end stages), and the command then shows the best
plan tpkit can run. The model is a `TrainModel`: `--preset NAME`, or `--from-hf FOLDER`
with the data of its tokenizer (a shape typed by hand runs from a Hugging Face folder of
that shape: `FOLDER` and `DATA_DIR` are then placeholders, explained in its note).
Megatron-LM flags (its `arguments.py` names) are given for every plan.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from tpkit.plan.layout import Layout
from tpkit.plan.memory import lighter_end_layers

MEGATRON_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}
AFTER_STEP_NOTE = ("FSDP after-step is priced as PyTorch FSDP2 runs fully_shard("
                   "reshard_after_forward=False) with set_reshard_after_backward(False) and "
                   "set_requires_gradient_sync(False) until the step's last backward (as "
                   "torch.distributed.pipelining does); the Megatron-FSDP flags above do not "
                   "say when it reshards")


DATA_PLACEHOLDER = "DATA_DIR"
FOLDER_PLACEHOLDER = "FOLDER"


@dataclass(frozen=True)
class TrainModel:
    """What the printed `tpkit train` line trains: its model (and data) flags, and a note
    saying what its placeholders stand for (None: the line runs as printed)."""

    flags: str
    note: str | None = None

    @classmethod
    def preset(cls, name: str, data: str | None = None) -> TrainModel:
        """A tpkit preset, trained on `data` (None: the default data)."""
        return cls(f"--preset {name}" + (f" --data {shlex.quote(data)}" if data else ""))

    @classmethod
    def hf(cls, folder: str | None, data: str | None = None) -> TrainModel:
        """A Hugging Face folder (None: a shape typed by hand, any folder of that shape) and
        the data tokenized by its tokenizer (None: the DATA_DIR placeholder)."""
        where = shlex.quote(folder) if folder else FOLDER_PLACEHOLDER
        notes = [] if folder else [
            f"{FOLDER_PLACEHOLDER}: a Hugging Face model folder of this shape (config.json and "
            f"safetensors weights, any family `tpkit train --from-hf` reads)"]
        if data is None:
            notes.append(f"{DATA_PLACEHOLDER}: `tpkit prepare-data TEXT_FILES --tokenizer "
                         f"{where} --out {DATA_PLACEHOLDER}` (or a .jsonl file)")
        flags = f"--from-hf {where} --data {shlex.quote(data) if data else DATA_PLACEHOLDER}"
        return cls(flags, "; ".join(notes) or None)


def tpkit_gaps(lay: Layout) -> list[str]:
    """What `tpkit train` cannot do of this plan (empty: it runs as planned)."""
    gaps = []
    if lay.lighter_ends:
        gaps.append("one layer fewer on the first and last stages")
    return gaps


def tpkit_command(model: TrainModel, lay: Layout, seq: int, global_batch: int, nodes: int,
                  per_node: int, bf16: bool = True, local: bool = False) -> str:
    """`tpkit train ...`, under torchrun unless the plan is local processes on one machine."""
    m = global_batch // (lay.dp * lay.micro_batch)  # micro-batches per step and replica
    flags = [model.flags, f"--tp {lay.tp}", f"--pp {lay.pp}", f"--dp {lay.dp}"]
    flags += [f"--cp {lay.cp}"] if lay.cp > 1 else []
    flags += ["--sp"] if lay.sp else []
    flags += {1: ["--zero1"], 2: ["--zero2"]}.get(lay.zero, [])
    flags += ["--fsdp", f"--fsdp-reshard {lay.fsdp_reshard}"] if lay.zero >= 3 else []
    flags += [f"--micro-batches {m}", f"--global-batch {global_batch}", f"--seq {seq}"]
    if lay.interleave > 1:
        flags += ["--schedule interleaved", f"--virtual-stages {lay.interleave}"]
    flags += ["--recompute"] if lay.recompute == "full" else []
    flags += ["--dtype bfloat16"] if bf16 else []
    if local and nodes == 1:
        return "tpkit train " + " ".join(flags)
    launch = f"torchrun --nproc_per_node {per_node}"
    if nodes > 1:
        launch = (f"torchrun --nnodes {nodes} --nproc_per_node {per_node} --node_rank "
                  f"$NODE_RANK --master_addr $MASTER_ADDR --master_port 29500")
    return f"{launch} -m tpkit train " + " ".join(flags)


def megatron_flags(lay: Layout, seq: int, global_batch: int, num_layers: int,
                   grad_bytes: int = 4, flash: bool = True, bf16: bool = True) -> str:
    """The same plan as Megatron-LM (pretrain_gpt.py) flags."""
    f = [f"--tensor-model-parallel-size {lay.tp}", f"--pipeline-model-parallel-size {lay.pp}"]
    f += [f"--context-parallel-size {lay.cp}"] if lay.cp > 1 else []
    f += ["--sequence-parallel"] if lay.sp else []
    f += [f"--micro-batch-size {lay.micro_batch}", f"--global-batch-size {global_batch}",
          f"--seq-length {seq}"] + (["--bf16"] if bf16 else [])
    if lay.interleave > 1 and lay.lighter_ends:  # (layers + 2) / (pp v) per chunk
        f.append(f"--num-virtual-stages-per-pipeline-rank {lay.interleave} "
                 f"--account-for-embedding-in-pipeline-split "
                 f"--account-for-loss-in-pipeline-split")
    elif lay.interleave > 1:
        f.append(f"--num-layers-per-virtual-pipeline-stage "
                 f"{num_layers // (lay.pp * lay.interleave)}")
    ends = lighter_end_layers(num_layers, lay.pp) if lay.lighter_ends else None
    if ends and lay.interleave == 1:
        f.append(f"--decoder-first-pipeline-num-layers {ends} "
                 f"--decoder-last-pipeline-num-layers {ends}")
    if lay.recompute == "selective":
        f.append("--recompute-granularity selective")
    elif lay.recompute == "full":
        f.append("--recompute-granularity full --recompute-method uniform "
                 "--recompute-num-layers 1")
    if lay.zero == 1:
        f.append("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")
    elif lay.zero >= 2:
        f.append(f"--use-megatron-fsdp --data-parallel-sharding-strategy "
                 f"{MEGATRON_SHARDING[lay.zero]} --use-distributed-optimizer "
                 f"--no-gradient-accumulation-fusion")
    elif lay.replicas > 1:
        f.append("--overlap-grad-reduce")
    f += ["--grad-reduce-in-bf16"] if grad_bytes == 2 else []
    f += ["--attention-backend flash"] if flash else []
    return " ".join(f)
