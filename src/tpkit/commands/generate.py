"""`tpkit generate`: load a model at a tensor-parallel layout (tpkit checkpoint, run
folder, full file or Hugging Face directory, opened once here: `weights.open_source`,
`weights.load_model`) and sample from it with the serving engine (`tpkit.serve.Engine`:
the same paged KV cache, sampler and stop strings as `tpkit serve`, so a prompt
gets the same tokens from both at the same `--max-batch`).

    tpkit generate --checkpoint hf-dir --tp 2 --prompt "The capital of France is"
    tpkit generate --checkpoint runs/x --prompt "a" --prompt "bcd"     # a batch of two
    tpkit generate --checkpoint hf-dir --chat --prompt "Hi" --stop "\n" --top-p 0.9 --temperature 0.7

Text goes through the model folder's own tokenizer (`tpkit.weights.tokenizer`; byte level
for tpkit's presets); one prompt streams as its tokens arrive, several are generated
together (continuous batching, `--max-batch` at once). Tokens per second go to stderr
at the end. `--dtype bfloat16` loads the weights and the KV cache in bfloat16 (the
sampling reads float32 logits); `--batch-invariant`: a prompt's tokens bit for bit the
same whatever else is generated with it (`tpkit.serve.engine`).
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext

from tpkit.commands.common import add_knobs, group, knob_values
from tpkit.decode.sampling import GREEDY_BELOW
from tpkit.launch import launch
from tpkit.mesh import ParallelMesh
from tpkit.serve import Engine, SamplingParams
from tpkit.serve.config import GENERATE, ServeConfig
from tpkit.serve.openai_api import ApiError, chat_ids
from tpkit.serve.params import MAX_TEMPERATURE, SamplingError, shown
from tpkit.serve.runner import Runner
from tpkit.serve.workers import follow, load
from tpkit.spec.errors import UserError
from tpkit.spec.transport import add_comm_argument, comm_choice
from tpkit.spec.words import plural
from tpkit.weights.sources import open_source, source_tokenizer
from tpkit.weights.tokenizer import ByteTokenizer, load_tokenizer


def _prompts(args: argparse.Namespace, tok) -> list[list[int]]:
    """Token ids of every --prompt (the model's tokenizer; --chat: as a user message in
    its chat template) or --prompt-ids."""
    if args.prompt_ids:
        return [_prompt_ids(p) for p in args.prompt_ids]
    if args.chat:
        try:
            return [chat_ids({"messages": [{"role": "user", "content": p}]}, tok, nullcontext(),
                             instead="drop --chat to send the prompt as it is")
                    for p in args.prompt]
        except ApiError as e:
            raise UserError(f"--chat: {e.message}") from None
    return [tok.encode(p) for p in args.prompt]


def _lead(mesh: ParallelMesh, args: argparse.Namespace, source) -> dict:
    """Rank 0: run the prompts through the serving engine (`tpkit.serve.Engine`: the same
    paged KV cache, scheduler and sampler as `tpkit serve`, so the same tokens) and stream
    the text of a single prompt as it comes, while the other ranks follow its steps
    (`serve.workers.follow`). `source`: the checkpoint, opened by `run`."""
    cfg = config(args)
    model = load(source, mesh, cfg)
    try:
        return _generate(args, cfg, source, model)
    finally:
        Runner.stop_followers(model)


def _generate(args: argparse.Namespace, cfg: ServeConfig, source, model) -> dict:
    tok = load_tokenizer(source_tokenizer(source))
    vocab, name = model.config.vocab_size, model.config.name
    if isinstance(tok, ByteTokenizer) and not args.prompt_ids and not model.config.byte_level:
        raise UserError(f"no tokenizer files in {source.where} and {name} (vocab_size="
                        f"{vocab}) is not a byte-level model; copy its tokenizer files "
                        f"there or pass --prompt-ids")
    prompts = _prompts(args, tok)
    engine = Engine(model, tokenizer=tok, **cfg.engine_options(model, tok))
    params = _sampling(args)
    for p in prompts:  # every prompt, before any is queued
        engine.check(p, params)
    t0 = time.perf_counter()
    streamed = len(prompts) == 1 and not args.prompt_ids and bool(args.max_new_tokens) \
        and not args.chat
    if streamed:
        print(args.prompt[0], end="", flush=True)
    reqs = engine.generate(prompts, params, on_token=_printer if streamed else None) \
        if args.max_new_tokens else []
    if streamed:
        print(flush=True)
    new = [r.result().tokens for r in reqs] or [[] for _ in prompts]
    seconds = time.perf_counter() - t0
    spec = engine.speculator
    return dict(new=new, seconds=seconds, streamed=streamed,
                texts=[_show(args, i, r) for i, r in enumerate(reqs)],
                speculated=None if spec is None else (spec.proposed, spec.accepted))


def _printer(_req, text: str) -> None:
    print(text, end="", flush=True)


def _show(args: argparse.Namespace, i: int, req) -> str:
    if args.prompt_ids:
        return " ".join(map(str, req.tokens))
    return ("" if args.chat else args.prompt[i]) + req.text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit generate`, under the shared headings (`tpkit.commands.common`):
    the prompts and their sampling, and the knobs of `ServeConfig` it shares with `tpkit
    serve` (`serve.config.GENERATE`)."""
    group(parser, "model").add_argument(
        "--checkpoint", required=True, help="tpkit checkpoint dir, run folder (its latest "
        "valid checkpoint), full .safetensors, or Hugging Face dir")
    group(parser, "parallelism", GENERATE[0].about)
    g = group(parser, "generation")
    g.add_argument("--prompt", action="append", default=[],
                   help="text, tokenized with the model folder's tokenizer (byte level "
                        "without one); repeat for a batch of prompts")
    g.add_argument("--prompt-ids", action="append", default=[],
                   help="comma-separated token ids instead (repeatable)")
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message in the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate after each prompt")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help=f"sampling temperature, at most {MAX_TEMPERATURE:g} (0, or below "
                        f"{GREEDY_BELOW:g}: greedy)")
    g.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample among the K likeliest tokens (default: all of them)")
    g.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample among the likeliest tokens of total probability P "
                        "(nucleus; default: all of them)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a prompt's text at TEXT (not printed); repeatable")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling (64-bit)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the tokenizer's end-of-sequence token")
    add_knobs(parser, ServeConfig, lambda k: k.section in GENERATE)
    add_comm_argument(group(parser, "parallelism"))


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise UserError(f"--prompt-ids={text!r} must be comma-separated integers") from None


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as the engine takes them (SamplingError: out of bounds)."""
    return SamplingParams(max_tokens=max(args.max_new_tokens, 1),
                          temperature=args.temperature,
                          top_k=0 if args.top_k is None else args.top_k,
                          top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed,
                          stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def _acceptance(speculated: tuple[int, int] | None) -> str:
    """', speculative: A of P proposed tokens accepted (R%)' (nothing without it)."""
    if speculated is None:
        return ""
    proposed, accepted = speculated
    rate = f" ({100 * accepted / proposed:.0f}%)" if proposed else ""
    return f", speculative: {accepted} of {plural(proposed, 'proposed token')} accepted{rate}"


def config(args: argparse.Namespace) -> ServeConfig:
    """The engine's `ServeConfig` from the flags (unchecked: `_check_args`). --max-batch's
    default: slots for the prompts given (at most 8), no row computed for nobody."""
    return ServeConfig(**{"max_batch": min(8, len(args.prompt_ids or args.prompt) or 1),
                          **knob_values(args, ServeConfig)})


def _check_args(args: argparse.Namespace) -> ServeConfig:
    """The engine's `ServeConfig`, or UserError for flags no model can accept (before
    loading anything)."""
    if not args.prompt and not args.prompt_ids:
        raise UserError("give --prompt or --prompt-ids")
    for p in args.prompt_ids or []:
        _prompt_ids(p)
    cfg = config(args)
    bad = []
    if args.max_new_tokens < 0:
        bad.append(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    try:
        _sampling(args)
    except SamplingError as e:  # the server's bounds (serve.params.RULES), as flags
        bad += [f"--{n.replace('_', '-')}={shown(v)} {must}" for n, v, must in e.problems]
    bad += cfg.problems()
    if bad:
        raise UserError("; ".join(bad))
    return cfg


def run(args: argparse.Namespace) -> int:
    """Generate on `--tp` local processes (or torchrun's); print the text and tokens/s.
    Mistakes (flags, paths, token ids) are `UserError`s: one line from `tpkit.cli`."""
    cfg = _check_args(args)
    comm = comm_choice(getattr(args, "comm", None))
    source = open_source(args.checkpoint)  # once, before any process
    result = launch(_lead, args, source, ranks=cfg.tp, mesh=dict(tp=cfg.tp, comm=comm),
                    follow=(follow, (source, cfg)))
    if result is None:  # a torchrun rank > 0: rank 0 prints
        return 0
    if not result["streamed"]:
        print("\n\n".join(result["texts"]))
    n = sum(len(r) for r in result["new"])
    print(f"[{plural(n, 'token')} ({plural(len(result['new']), 'prompt')}) in "
          f"{result['seconds']:.2f} s: {n / max(result['seconds'], 1e-9):.1f} tokens/s, "
          f"tp={cfg.tp}{_acceptance(result['speculated'])}]", file=sys.stderr)
    return 0
