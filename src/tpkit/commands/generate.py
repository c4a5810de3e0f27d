"""`tpkit generate`: load a model at a tensor-parallel layout (tpkit checkpoint, full
file or Hugging Face directory) and sample from it (`tpkit.model.generate`).

A command sits on top of the stack: it may use training's checkpoints, while
`tpkit.model` knows nothing of training.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
from torch import nn

from tpkit.mesh import ParallelMesh
from tpkit.model.generate import decode, encode, generate
from tpkit.spec.errors import UserError


def load_model(path: str | Path, mesh: ParallelMesh, dtype: torch.dtype | None = None
               ) -> nn.Module:
    """A model at `mesh`'s layout from a tpkit checkpoint dir, full file or HF directory."""
    from tpkit.checkpoint import store as ckpt
    from tpkit.checkpoint.convert import open_source
    from tpkit.model.hf import build_model, from_pretrained, load_from, materialize

    path = Path(path)
    if (path / "config.json").is_file() and not (path / "manifest.json").is_file():
        return from_pretrained(path, mesh, dtype=dtype)
    source, config, names = open_source(path)
    model = build_model(config, mesh, device="meta", dtype=dtype,
                        pooler="pooler.weight" in names)
    materialize(model, mesh.device)
    if (path / "manifest.json").is_file():
        ckpt.load(path, model, mesh=mesh)
    else:
        load_from(model, source, mesh, str(path))
    return model


def _worker(mesh: ParallelMesh, args: argparse.Namespace) -> str:
    model = load_model(args.checkpoint, mesh)
    vocab = model.config.vocab_size
    if args.prompt_ids:
        prompt = _prompt_ids(args.prompt_ids)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise UserError(f"--prompt-ids: token ids {bad} are outside the model's "
                            f"vocabulary [0, {vocab})")
    else:
        prompt = encode(args.prompt)
        if vocab < 256:
            raise UserError(f"vocab_size={vocab} < 256: not a byte-level model; pass "
                            f"--prompt-ids")
    ids = torch.tensor([prompt], device=mesh.device)
    out = generate(model, ids, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed)[0].tolist()
    new = out[len(prompt):]
    return " ".join(map(str, new)) if args.prompt_ids else args.prompt + decode(new)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit generate`."""
    parser.add_argument("--checkpoint", required=True,
                        help="tpkit checkpoint dir, full .safetensors, or Hugging Face dir")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel processes")
    parser.add_argument("--prompt", default="", help="text (byte-level tokenizer)")
    parser.add_argument("--prompt-ids", default="", help="comma-separated token ids instead")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise UserError(f"--prompt-ids={text!r} must be comma-separated integers") from None


def _check_args(args: argparse.Namespace) -> None:
    """UserError for flags no model can accept (before loading anything)."""
    if not args.prompt and not args.prompt_ids:
        raise UserError("give --prompt or --prompt-ids")
    if args.prompt_ids:
        _prompt_ids(args.prompt_ids)
    bad = [f"--tp={args.tp} must be a positive integer"] if args.tp < 1 else []
    if args.max_new_tokens < 0:
        bad.append(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        bad.append(f"--temperature={args.temperature} must be a finite number >= 0 "
                   f"(0: greedy)")
    if args.top_k is not None and args.top_k < 0:
        bad.append(f"--top-k={args.top_k} must be >= 0 (0: off)")
    if bad:
        raise UserError("; ".join(bad))


def run(args: argparse.Namespace) -> int:
    """Generate on `--tp` local processes (or torchrun's) and print the text."""
    _check_args(args)
    if "WORLD_SIZE" in os.environ:
        text = _worker(ParallelMesh.from_env(tp=args.tp, pp=1), args)
    elif args.tp == 1:
        text = _worker(ParallelMesh.single(), args)
    else:
        from tpkit.launch import spawn

        text = spawn(_worker, args.tp, args, mesh=dict(tp=args.tp))[0]
    print(text)
    return 0
