"""`tpkit convert`: checkpoints to and from one full safetensors file, offline resharding,
Hugging Face export (`tpkit.checkpoint.convert`), in one process.

    tpkit convert runs/demo model.safetensors --to full                # a run folder: latest
    tpkit convert model.safetensors ckpt-tp4 --to sharded --tp 4 --pp 2
    tpkit convert runs/ckpt/step-100 ckpt-tp1 --to sharded --tp 1     # + optimizer state
    tpkit convert runs/ckpt/step-100 hf-out --to hf                    # transformers loads it
    tpkit convert runs/lora adapter --to peft            # LoRA: PeftModel.from_pretrained
    tpkit convert runs/lora merged --to hf --merge       # LoRA: folded into the weights

DEST is a new name or an empty folder; an earlier output of tpkit of the same kind is
replaced only with --overwrite; anything else there, a DEST inside or around the
source, or inside a checkpoint or a run's checkpoints folder, is refused in one line
(`tpkit.checkpoint.dest`).
"""

from __future__ import annotations

import argparse

from tpkit.checkpoint.convert import reshard, to_full, to_hf, to_peft
from tpkit.commands.common import group
from tpkit.spec.errors import UserError
from tpkit.weights.paths import locate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit convert`."""
    parser.add_argument("source", help="tpkit checkpoint dir, run folder (its latest valid "
                                       "checkpoint), full .safetensors, or HF dir")
    parser.add_argument("dest", help="output path: a new name or an empty folder")
    parser.add_argument("--to", choices=("full", "sharded", "hf", "peft"), default="sharded",
                        help="one full safetensors file, a sharded checkpoint, Hugging Face, "
                             "or (a run of tpkit train --lora-rank) PEFT's adapter folder")
    parser.add_argument("--merge", action="store_true",
                        help="--to hf of a LoRA run: the model with its adapters folded into "
                             "the weights (W + alpha/r B A)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace DEST when it is an earlier output of tpkit of the same "
                             "kind (anything else there is never replaced)")
    layout = group(parser, "parallelism")
    layout.add_argument("--tp", type=int, default=1, metavar="N",
                        help="tensor-parallel size (sharded)")
    layout.add_argument("--pp", type=int, default=1, metavar="N",
                        help="pipeline stages (sharded)")


def run(args: argparse.Namespace) -> int:
    """Convert; print the checkpoint read and what was written. Errors (a CheckpointError,
    a UserError) name the file and the problem, on one line, from `tpkit.cli`."""
    if args.merge and args.to != "hf":
        raise UserError(f"--merge folds LoRA adapters into a Hugging Face export: it goes "
                        f"with --to hf, not --to {args.to}")
    source = locate(args.source, optimizer=args.to == "sharded")  # a run folder: its latest valid checkpoint
    print(f"read {source.path}")
    if args.to == "full":
        out = to_full(source, args.dest, overwrite=args.overwrite)
    elif args.to == "hf":
        out = to_hf(source, args.dest, overwrite=args.overwrite, merge=args.merge)
    elif args.to == "peft":
        out = to_peft(source, args.dest, overwrite=args.overwrite)
    else:
        out = reshard(source, args.dest, args.tp, args.pp, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0
