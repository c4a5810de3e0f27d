"""`tpkit generate`: load a model at a tensor-parallel layout (tpkit checkpoint, run
folder, full file or Hugging Face directory, opened once here: `checkpoint.open_source`,
`checkpoint.load_model`) and sample from it (`model.generate`).

    tpkit generate --checkpoint hf-dir --tp 2 --prompt "The capital of France is"
    tpkit generate --checkpoint runs/x --prompt "a" --prompt "bcd"     # a batch of two

Text goes through the model folder's own tokenizer (`tpkit.model.tokenizer`; byte level
for tpkit's presets); one prompt streams as its tokens arrive, several are generated
as one left-padded batch. Tokens per second go to stderr at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from tpkit.checkpoint.sources import load_model, open_source, source_tokenizer
from tpkit.commands.common import group
from tpkit.mesh import ParallelMesh
from tpkit.model.generate import generate, pad_left
from tpkit.model.tokenizer import ByteTokenizer, TextStream, load_tokenizer
from tpkit.spec.errors import UserError
from tpkit.spec.transport import add_comm_argument, comm_choice


def _prompts(args: argparse.Namespace, tok) -> list[list[int]]:
    """Token ids of every --prompt (the model's tokenizer) or --prompt-ids."""
    if args.prompt_ids:
        return [_prompt_ids(p) for p in args.prompt_ids]
    return [tok.encode(p) for p in args.prompt]


def _worker(mesh: ParallelMesh, args: argparse.Namespace, source) -> dict:
    """Generate on this rank (`source`: the checkpoint, opened by `run`); rank 0 streams
    the text of a single prompt as it comes."""
    model = load_model(source, mesh)
    tok = load_tokenizer(source_tokenizer(source))
    vocab = model.config.vocab_size
    name = model.config.name
    if isinstance(tok, ByteTokenizer) and not args.prompt_ids and not model.config.byte_level:
        raise UserError(f"no tokenizer files in {source.where} and {name} (vocab_size="
                        f"{vocab}) is not a byte-level model; copy its tokenizer files "
                        f"there or pass --prompt-ids")
    prompts = _prompts(args, tok)
    bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab})
    if bad:
        raise UserError(f"prompt token ids {bad} are outside the model's vocabulary "
                        f"[0, {vocab})")
    ids, mask = pad_left(prompts, tok.pad_id, mesh.device)
    stream = TextStream(tok) if len(prompts) == 1 and mesh.rank == 0 and not args.prompt_ids \
        else None
    if stream is not None:
        print(args.prompt[0], end="", flush=True)
    t0 = time.perf_counter()
    out = generate(model, ids, args.max_new_tokens, attention_mask=mask,
                   temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                   eos_id=None if args.ignore_eos else tok.eos_ids, pad_id=tok.pad_id,
                   on_tokens=(lambda t: print(stream.push(t), end="", flush=True))
                   if stream is not None else None)
    seconds = time.perf_counter() - t0
    new = [row[ids.shape[1]:] for row in out.tolist()]
    if stream is not None:
        print(stream.flush(), flush=True)
    return dict(new=new, seconds=seconds, streamed=stream is not None,
                texts=[_show(args, tok, i, row) for i, row in enumerate(new)])


def _show(args: argparse.Namespace, tok, i: int, new: list[int]) -> str:
    if args.prompt_ids:
        return " ".join(map(str, new))
    return args.prompt[i] + tok.decode(new)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit generate`, under the shared headings (`tpkit.commands.common`)."""
    group(parser, "model").add_argument(
        "--checkpoint", required=True, help="tpkit checkpoint dir, run folder (its latest "
        "valid checkpoint), full .safetensors, or Hugging Face dir")
    group(parser, "parallelism").add_argument("--tp", type=int, default=1, metavar="N",
                                              help="tensor-parallel processes")
    g = group(parser, "generation")
    g.add_argument("--prompt", action="append", default=[],
                   help="text, tokenized with the model folder's tokenizer (byte level "
                        "without one); repeat for a batch of prompts")
    g.add_argument("--prompt-ids", action="append", default=[],
                   help="comma-separated token ids instead (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate after each prompt")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (0: greedy)")
    g.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample among the K likeliest tokens (default: all of them)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the tokenizer's end-of-sequence token")
    add_comm_argument(group(parser, "parallelism"))


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise UserError(f"--prompt-ids={text!r} must be comma-separated integers") from None


def _check_args(args: argparse.Namespace) -> None:
    """UserError for flags no model can accept (before loading anything)."""
    if not args.prompt and not args.prompt_ids:
        raise UserError("give --prompt or --prompt-ids")
    for p in args.prompt_ids or []:
        _prompt_ids(p)
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
    """Generate on `--tp` local processes (or torchrun's); print the text and tokens/s.
    Mistakes (flags, paths, token ids) are `UserError`s: one line from `tpkit.cli`."""
    _check_args(args)
    comm = comm_choice(getattr(args, "comm", None))
    source = open_source(args.checkpoint)  # once, before any process
    if "WORLD_SIZE" in os.environ:
        result = _worker(ParallelMesh.from_env(tp=args.tp, pp=1, comm=comm), args, source)
    elif args.tp == 1:
        result = _worker(ParallelMesh.single(), args, source)
    else:
        from tpkit.launch import spawn

        result = spawn(_worker, args.tp, args, source, mesh=dict(tp=args.tp, comm=comm))[0]
    if not result["streamed"]:
        print("\n\n".join(result["texts"]))
    n = sum(len(r) for r in result["new"])
    print(f"[{n} tokens ({len(result['new'])} x {len(result['new'][0])}) in "
          f"{result['seconds']:.2f} s: {n / max(result['seconds'], 1e-9):.1f} tokens/s, "
          f"tp={args.tp}]", file=sys.stderr)
    return 0
