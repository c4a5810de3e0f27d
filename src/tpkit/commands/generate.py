"""`tpkit generate`: load a model at a tensor-parallel layout (tpkit checkpoint, run
folder, full file or Hugging Face directory: `tpkit.checkpoint.load_model`) and sample
from it (`tpkit.model.generate`).
"""

from __future__ import annotations

import argparse
import os

import torch

from tpkit.checkpoint.files import CheckpointError
from tpkit.checkpoint.locate import locate
from tpkit.checkpoint.sources import load_model
from tpkit.mesh import ParallelMesh
from tpkit.model.generate import decode, encode, generate


def _worker(mesh: ParallelMesh, args: argparse.Namespace) -> str:
    model = load_model(args.checkpoint, mesh)
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    else:
        prompt = encode(args.prompt)
        if model.config.vocab_size < 256:
            raise ValueError(f"vocab_size={model.config.vocab_size} < 256: not a byte-level "
                             f"model; pass --prompt-ids")
    ids = torch.tensor([prompt], device=mesh.device)
    out = generate(model, ids, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed)[0].tolist()
    new = out[len(prompt):]
    return " ".join(map(str, new)) if args.prompt_ids else args.prompt + decode(new)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit generate`."""
    parser.add_argument("--checkpoint", required=True,
                        help="tpkit checkpoint dir, run folder (its latest valid "
                             "checkpoint), full .safetensors, or Hugging Face dir")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes")
    parser.add_argument("--prompt", default="", help="text (byte-level tokenizer)")
    parser.add_argument("--prompt-ids", default="", help="comma-separated token ids instead")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Generate on `--tp` local processes (or torchrun's) and print the text."""
    if not args.prompt and not args.prompt_ids:
        print("tpkit generate: give --prompt or --prompt-ids")
        return 2
    try:
        args.checkpoint = str(locate(args.checkpoint).path)  # once, before any process
        if "WORLD_SIZE" in os.environ:
            text = _worker(ParallelMesh.from_env(tp=args.tp, pp=1), args)
        elif args.tp == 1:
            text = _worker(ParallelMesh.single(), args)
        else:
            from tpkit.launch import spawn

            text = spawn(_worker, args.tp, args, mesh=dict(tp=args.tp))[0]
    except (ValueError, CheckpointError) as e:
        print(f"tpkit generate: {e}")
        return 1
    print(text)
    return 0
