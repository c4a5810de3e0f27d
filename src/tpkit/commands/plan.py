"""`tpkit plan`: the best tp/pp/dp layouts for a model on a cluster, as a table or JSON.

    tpkit plan --preset llama3-70b --nodes 8 --gpus-per-node 8 --hardware h100
    tpkit plan --hf path/to/SmolLM2-135M-Instruct --hardware cpu --gpus-per-node 2
    tpkit plan --heads 32 --hidden 4096 --layers 32 --vocab 32000 --seq 4096 --json
    tpkit plan --preset gpt3-175b --nodes 16 --hardware a100-80gb --explain --top 3
    tpkit plan --preset llama3-8b --nodes 16 --seq 131072 --global-batch 16 --cp 16

Below the table: what each column means, then plan #1 as Megatron-LM flags and as a
`tpkit train` command line (or the best plan tpkit itself can run, when plan #1 needs
lighter end stages): `--preset NAME` for a preset, `--from-hf FOLDER --data DATA_DIR` for
a Hugging Face folder or a shape typed by hand (placeholders explained under the line).
"""

from __future__ import annotations

import argparse
import json

from tpkit.plan.command_line import TrainModel, tpkit_gaps
from tpkit.plan.hardware import PROFILES, get_hardware
from tpkit.plan.layout import ZERO_NAMES
from tpkit.plan.memory import GRAD_DTYPES, Precision
from tpkit.plan.planner import PlanError, Request, best_per_degrees, plan
from tpkit.plan.simulate import Cluster
from tpkit.plan.tables import (
    commands_dict,
    legend,
    plan_dict,
    print_commands,
    print_explain,
    print_table,
)
from tpkit.spec.config import ModelConfig, get_preset
from tpkit.spec.theory import FSDP_RESHARD

SEARCHED = " (default: searched)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `tpkit plan`."""
    m = p.add_argument_group("model (a preset, a Hugging Face folder, or a custom shape)")
    m.add_argument("--preset", metavar="NAME",
                   help="a tpkit.model preset, e.g. llama3-70b, gpt3-175b (default: none, a "
                        "custom shape)")
    m.add_argument("--hf", "--from-hf", metavar="FOLDER", dest="hf",
                   help="a Hugging Face model folder (its config.json, read as `tpkit train "
                        "--from-hf` reads it) (default: none)")
    m.add_argument("--data", metavar="PATH",
                   help="the data the printed `tpkit train` line trains on (default: a "
                        "preset's default data; with --hf the placeholder DATA_DIR)")
    for flag, help_ in (("--heads", "attention heads (default: the preset's)"),
                        ("--hidden", "hidden size (default: the preset's)"),
                        ("--layers", "transformer layers (default: the preset's)"),
                        ("--vocab", "vocabulary size (default: the preset's)"),
                        ("--kv-heads", "key/value heads (GQA; default = heads)"),
                        ("--ffn", "MLP width (default 4 x hidden)")):
        m.add_argument(flag, type=int, metavar="N", help=help_)
    m.add_argument("--swiglu", action="store_true", help="Llama-style MLP (3 matrices)")
    c = p.add_argument_group("cluster and run")
    c.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes in the cluster")
    c.add_argument("--gpus-per-node", type=int, help="devices per node (default: the profile's)")
    c.add_argument("--hardware", default="h100",
                   help=f"{', '.join(PROFILES)}, local (after `tpkit calibrate`)")
    c.add_argument("--hardware-file", metavar="PATH",
                   help="TOML file with more profiles (default: none)")
    c.add_argument("--seq", type=int, help="sequence length (default: the model's, max 4096)")
    c.add_argument("--global-batch", type=int, help="sequences per step (default 8 x devices)")
    c.add_argument("--grad-dtype", choices=tuple(GRAD_DTYPES), default="fp32",
                   help="gradient precision (default fp32: Megatron-Core's main gradients "
                        "with bf16 training; bf16 = --grad-reduce-in-bf16)")
    c.add_argument("--no-flash", action="store_true",
                   help="attention without a fused kernel (scores kept in memory)")
    f = p.add_argument_group("pin choices (default: search them)")
    for flag, help_ in (("--tp", "tensor-parallel size"), ("--cp", "context-parallel size"),
                        ("--pp", "pipeline stages"), ("--dp", "data-parallel replicas"),
                        ("--micro-batch", "sequences per micro-batch"),
                        ("--interleave", "virtual pipeline chunks per device")):
        f.add_argument(flag, type=int, metavar="N", help=help_ + SEARCHED)
    f.add_argument("--recompute", choices=("none", "selective", "full"),
                   help="activation recomputation" + SEARCHED)
    f.add_argument("--sp", choices=("on", "off"), help="sequence parallelism" + SEARCHED)
    f.add_argument("--zero", type=int, choices=tuple(ZERO_NAMES),
                   help="data-parallel sharding: " + ", ".join(
                       f"{k} {v}" for k, v in ZERO_NAMES.items()) + SEARCHED)
    f.add_argument("--zero1", choices=("on", "off"),
                   help="same as --zero 1 / --zero 0" + SEARCHED)
    f.add_argument("--fsdp-reshard", choices=FSDP_RESHARD,
                   help="when FSDP frees the weights it gathered: after-forward (PyTorch "
                        "FSDP2's default, reshard_after_forward=True: gathered again for every "
                        "micro-batch's forward and backward, gradients reduce-scattered each "
                        "micro-batch) or after-step (reshard_after_forward=False, no "
                        "resharding or gradient sync until the last backward, as "
                        "torch.distributed.pipelining runs it: gathered once per step and kept, "
                        "gradients accumulated unsharded and reduce-scattered once; the "
                        "stage's full weights and gradients stay in memory)" + SEARCHED)
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=8, help="how many plans to show")
    o.add_argument("--json", action="store_true", help="JSON list of plans, best first")
    o.add_argument("--explain", action="store_true", help="per-layer breakdown of each plan")
    o.add_argument("--all", action="store_true",
                   help="every variant, not the best per (tp, cp, pp)")
    p.epilog = "table columns:\n" + legend()
    p.formatter_class = argparse.RawDescriptionHelpFormatter


def model_from_args(a: argparse.Namespace) -> ModelConfig:
    """The preset, the Hugging Face folder's shape, or a custom model from --heads --hidden
    --layers --vocab (--seq)."""
    custom = {"num_heads": a.heads, "hidden": a.hidden, "num_layers": a.layers,
              "vocab_size": a.vocab}
    if a.preset and a.hf:
        raise PlanError("give --preset or --hf, not both")
    if a.preset or a.hf:
        cfg = get_preset(a.preset) if a.preset else _hf_shape(a.hf)
        return cfg.with_(**{k: v for k, v in custom.items() if v is not None})
    missing = [k for k, v in zip(("--heads", "--hidden", "--layers", "--vocab"), custom.values())
               if v is None]
    if missing:
        raise PlanError(f"give --preset, or a custom model with {' '.join(missing)} (and --seq)")
    return ModelConfig(name="custom", max_seq_len=a.seq or 2048, kv_heads=a.kv_heads,
                       ffn=a.ffn, activation="swiglu" if a.swiglu else "gelu", **custom)


def _hf_shape(folder: str) -> ModelConfig:
    """A Hugging Face folder's ModelConfig, read by the loader's own reader (its config.json
    and tensor names, no weights)."""
    from tpkit.weights.hf import hf_config  # lazy: torch, which the planner does without

    return hf_config(folder)


def train_model(a: argparse.Namespace) -> TrainModel:
    """What the printed `tpkit train` line trains: the preset, the folder, or (a shape
    typed by hand or changed by shape flags) any Hugging Face folder of that shape."""
    if _customised(a):
        return TrainModel.hf(None, a.data)
    return TrainModel.preset(a.preset, a.data) if a.preset else TrainModel.hf(a.hf, a.data)


def request_from_args(a: argparse.Namespace) -> Request:
    """Model, cluster and pinned choices from the command line."""
    cfg = model_from_args(a)
    if (a.preset or a.hf) and (a.kv_heads or a.ffn):
        cfg = cfg.with_(kv_heads=a.kv_heads or cfg.kv_heads, ffn=a.ffn or cfg.ffn)
    seq = a.seq or min(cfg.max_seq_len, 4096)
    if seq > cfg.max_seq_len:
        cfg = cfg.with_(max_seq_len=seq)
    hw = get_hardware(a.hardware, a.hardware_file)
    cluster = Cluster(hw, nodes=a.nodes, devices_per_node=a.gpus_per_node,
                      flash_attention=not a.no_flash)
    onoff = {"on": True, "off": False, None: None}
    zero = a.zero if a.zero is not None else {"on": 1, "off": 0, None: None}[a.zero1]
    fixed = {"tp": a.tp, "cp": a.cp, "pp": a.pp, "dp": a.dp, "micro_batch": a.micro_batch,
             "interleave": a.interleave, "recompute": a.recompute, "sp": onoff[a.sp],
             "zero": zero, "fsdp_reshard": a.fsdp_reshard}
    gbs = a.global_batch or 8 * cluster.devices
    prec = Precision.for_dtype(hw.accelerator.dtype, a.grad_dtype)
    return Request(cfg, seq, gbs, cluster, {k: v for k, v in fixed.items() if v is not None},
                   prec)


def run(args: argparse.Namespace) -> int:
    """Print the plans and how to run the best; no plan that fits is one line naming why
    (exit 2, from `tpkit.cli`)."""
    req = request_from_args(args)  # a bad flag or no plan that fits: UserError, one line
    everything = plan(req, distinct=False)
    plans = (everything if args.all else best_per_degrees(everything))[:args.top]
    model = train_model(args)
    runnable = next((e for e in everything if not tpkit_gaps(e.layout)), None)
    if args.json:
        print(json.dumps([{**plan_dict(e), "commands": commands_dict(req, e, model)}
                          for e in plans], indent=1))
        return 0

    print_table(req, plans)
    print_commands(req, plans, runnable, model)
    if args.explain:
        for e in plans:
            print_explain(req, e)
    return 0


def _customised(a: argparse.Namespace) -> bool:
    """A shape typed by hand, or a preset or folder changed by shape flags, is no longer
    what `tpkit train --preset` / `--from-hf FOLDER` builds."""
    return not (a.preset or a.hf) or any(
        v is not None for v in (a.heads, a.hidden, a.layers, a.vocab, a.kv_heads, a.ffn))
