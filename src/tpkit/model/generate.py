"""`tpkit generate`: tensor-parallel text generation with a KV cache.

    tpkit generate --checkpoint runs/demo/ckpt/step-200 --tp 2 --prompt "Tensor"

Each rank keeps the keys and values of *its own* heads only ([b, kv_local, t, hd]
per layer, `KVCache`): the cache is split over tp exactly like the qkv weights, so
tp ranks hold 1/tp of it each (GQA kv heads shared when num_kv_heads < tp).

    prompt [b, s] --forward, fills caches--> logits [b, s, V/tp] --last position-->
    all-gather over tp -> [b, V] -> same token on every rank (same logits, same seed)
    token [b, 1] --forward at position_offset = t, appends to caches--> ...

Two all-reduces per layer per token (as in training) plus one all-gather of the last
logits. tpkit checkpoints use a byte-level tokenizer (ids 0..255 are UTF-8 bytes).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

from tpkit.comm import all_gather
from tpkit.layers.attention import KVCache
from tpkit.mesh import ParallelMesh


@torch.no_grad()
def generate(model: nn.Module, ids: torch.Tensor, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
             eos_id: int | None = None) -> torch.Tensor:
    """ids [b, s] -> [b, s + n]: greedy when temperature == 0, else sampled (top-k).

    Call on every tp rank of a pp=1 model; every rank returns the same tokens.
    """
    if not (model.is_first_stage and model.is_last_stage):
        raise ValueError("generate needs pp=1 (every stage's layers on each rank)")
    if ids.shape[1] + max_new_tokens > model.config.max_seq_len:
        raise ValueError(f"prompt {ids.shape[1]} + {max_new_tokens} new tokens exceeds "
                         f"max_seq_len={model.config.max_seq_len}")
    model.eval()
    caches = [KVCache() for _ in model.layers]
    gen = torch.Generator(device=ids.device).manual_seed(seed)  # same draw on every rank
    out, x, offset = ids, ids, 0
    for _ in range(max_new_tokens):
        logits = model(x, kv_caches=caches, position_offset=offset)  # [b, s, V_pad/tp]
        offset += x.shape[1]
        last = all_gather(logits[:, -1], model.group, dim=-1)  # [b, V_pad]
        x = pick(last[:, :model.config.vocab_size], temperature, top_k, gen)  # [b, 1]
        out = torch.cat([out, x], dim=1)
        if eos_id is not None and bool((x == eos_id).all()):
            break
    return out


def pick(logits: torch.Tensor, temperature: float, top_k: int | None,
         gen: torch.Generator) -> torch.Tensor:
    """Next token [b, 1] from full logits [b, V]."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen)


def encode(text: str) -> list[int]:
    """Byte-level tokenizer of tpkit checkpoints: UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    """Inverse of `encode` (ids >= 256 are dropped; bad UTF-8 replaced)."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def load_model(path: str | Path, mesh: ParallelMesh, dtype: torch.dtype | None = None
               ) -> nn.Module:
    """A model at `mesh`'s layout from a tpkit checkpoint dir, full file or HF directory."""
    from tpkit.model.hf import build_model, from_pretrained, load_from, materialize
    from tpkit.train import checkpoint as ckpt
    from tpkit.train.convert import open_source

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
                        help="tpkit checkpoint dir, full .safetensors, or Hugging Face dir")
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
        if "WORLD_SIZE" in os.environ:
            text = _worker(ParallelMesh.from_env(tp=args.tp, pp=1), args)
        elif args.tp == 1:
            text = _worker(ParallelMesh.single(), args)
        else:
            from tpkit.launch import spawn

            text = spawn(_worker, args.tp, args, mesh=dict(tp=args.tp))[0]
    except ValueError as e:  # CheckpointError is a RuntimeError: let it name its file
        print(f"tpkit generate: {e}")
        return 1
    print(text)
    return 0
