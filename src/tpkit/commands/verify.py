"""`tpkit verify`: build a component (or a whole model) at several tp from one seed, run
forward + backward on the same batch, and compare everything with tp=1.

    tpkit verify --component mlp --tp 1,2,4 [--hidden H --batch B --seq S]
    tpkit verify --preset llama-tiny --tp 1,2,4 [--sp] [--dtype float32|bfloat16]
    tpkit verify --checkpoint runs/demo --tp 1,2    # weights and config from any path
    tpkit verify --hf path/to/hf-model --tp 1,2,4 [--sp] [--expert-parallel]
                                                            # against transformers itself
    tpkit verify --hf path/to/hf-model --tp 1,2 --dtype bfloat16   # both in bfloat16

Prints per tp the max abs difference of outputs (logits), loss and gathered
gradients against tp=1, the ledger per layer next to the theory, and the parameter
bytes per rank; exits non-zero on any mismatch. The work is `tpkit.check.exactness`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from functools import partial

import torch
from rich.table import Table

from tpkit.check.exactness import (
    LOSS_ULPS,
    TOL,
    TPResult,
    compare_tps,
    loss_bound,
    mlp_case,
    model_case,
    sweep,
)
from tpkit.comm.ledger_tables import human_bytes, render
from tpkit.commands.common import group
from tpkit.spec import get_preset
from tpkit.spec.errors import UserError
from tpkit.spec.transport import add_comm_argument, comm_choice
from tpkit.weights import hf_check
from tpkit.weights.build import build_model
from tpkit.weights.hf import hf_source
from tpkit.weights.sources import load_model, open_source

TOL_HF = 1e-4  # against transformers: another implementation, float32
# against transformers in a low-precision dtype (both sides in it): relative differences
# (max |Δ| / the reference's max |value|) within HF_UNITS units of the dtype's rounding
# (u = 2^-8 for bfloat16: 8 significant bits): two implementations round at different
# places, and the differences grow through the layers
HF_UNITS = {"bfloat16": (2.0 ** -8, 16)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `tpkit verify`."""
    p.add_argument("--component", choices=["mlp", "model"], default=None,
                   help="mlp: the Megatron MLP alone; model: a whole preset (default with --preset)")
    m = group(p, "model")
    m.add_argument("--preset", default=None, metavar="NAME",
                   help="model preset, e.g. gpt2-tiny, llama-tiny (default: none)")
    m.add_argument("--checkpoint", default=None,
                   help="a model from a checkpoint dir, run folder (its latest valid "
                        "checkpoint), full .safetensors or Hugging Face dir, instead of a "
                        "preset (default: none)")
    m.add_argument("--hf", default=None, metavar="DIR",
                   help="a Hugging Face model directory: every tp against transformers "
                        "(default: none)")
    layout = group(p, "parallelism")
    layout.add_argument("--tp", default="1,2,4", metavar="LIST",
                        help="comma-separated tp sizes (1 is the reference)")
    layout.add_argument("--sp", action="store_true", help="sequence parallelism")
    layout.add_argument("--expert-parallel", action="store_true",
                        help="with --hf, mixture-of-experts models: whole experts spread over tp")
    m.add_argument("--activation", default="gelu", choices=["gelu", "swiglu", "relu"],
                   help="MLP activation (--component mlp)")
    m.add_argument("--hidden", type=int, default=64, metavar="N",
                   help="hidden size (--component mlp)")
    m.add_argument("--ffn", type=int, default=None, metavar="N",
                   help="MLP width (default: 4*hidden)")
    data = group(p, "data")
    data.add_argument("--batch", type=int, default=2, metavar="N",
                      help="sequences in the test batch")
    data.add_argument("--seq", type=int, default=16, metavar="N", help="sequence length")
    m.add_argument("--layers", type=int, default=None, metavar="N",
                   help="override the preset's layer count (default: the preset's)")
    m.add_argument("--dtype", choices=list(TOL), default="float32",
                   help="compute dtype (its tolerance against tp=1 follows)")
    group(p, "reliability").add_argument(
        "--timeout", type=float, default=300.0, metavar="S",
        help="seconds the worker processes may take before they are stopped")
    add_comm_argument(layout)


def _builder(args: argparse.Namespace):
    """A picklable `build(mesh)` of the model to verify: from `--checkpoint`, else the
    preset's (seed 1, `--layers` if given)."""
    dtype = getattr(torch, args.dtype)
    if args.checkpoint:
        return partial(load_model, args.checkpoint, dtype=dtype, sequence_parallel=args.sp)

    cfg = get_preset(args.preset)
    if args.layers:
        cfg = replace(cfg, num_layers=args.layers)
    return partial(build_model, cfg, seed=1, sequence_parallel=args.sp, dtype=dtype)


def run(args: argparse.Namespace) -> int:
    """Run the comparison; 0 when every tp matches tp=1 (or transformers, with --hf) and
    the ledger matches theory."""
    _one_model(args)
    if args.hf:
        return _run_hf(args)
    component = args.component or ("model" if args.preset or args.checkpoint else "mlp")
    tps = _check_args(args, component)
    # once, before any process: every tp reads the same checkpoint
    args.checkpoint = args.checkpoint and open_source(args.checkpoint)
    if args.checkpoint and args.checkpoint.config is not None:
        _refuse(args.checkpoint.config, tps, args)
    opts = dict(vars(args), ffn=args.ffn or 4 * args.hidden)
    what = f"MLP {args.activation} h={args.hidden} ffn={opts['ffn']}" if component == "mlp" \
        else f"{args.checkpoint.where if args.checkpoint else args.preset}" \
             f"{' +SP' if args.sp else ''}"
    print(f"tpkit verify: {what}, batch={args.batch} seq={args.seq} {args.dtype}, tp={tps}")
    case, build = (mlp_case, None) if component == "mlp" else (model_case, _builder(args))
    comm = comm_choice(getattr(args, "comm", None))
    ref, rows = compare_tps(case, opts, tps, build, args.timeout, comm=comm)
    return _report(rows, tps, TOL[args.dtype], loss_bound(ref["loss"], args.dtype), "tp=1",
                   args.dtype)


def _one_model(args: argparse.Namespace) -> None:
    """--preset, --checkpoint and --hf each name the model (a checkpoint and a Hugging
    Face folder carry their own config): a UserError when more than one is given, or
    --layers (a preset's override) without --preset."""
    given = [f"--{k} {v}" for k in ("preset", "checkpoint", "hf") if (v := getattr(args, k))]
    if len(given) > 1:
        raise UserError(f"{' and '.join(given)}: each names the model to verify (a "
                        f"checkpoint or a Hugging Face folder brings its own config); "
                        f"give one of them")
    if args.layers and not args.preset:
        raise UserError(f"--layers {args.layers} overrides a preset's layer count: it needs "
                        f"--preset (a checkpoint's model is verified as it was saved)")


def _check_args(args: argparse.Namespace, component: str) -> list[int]:
    """The tp sizes to compare (1 included); UserError for what cannot run at all."""
    if component == "model" and not (args.preset or args.checkpoint):
        raise UserError("--component model needs --preset or --checkpoint")
    try:
        tps = sorted({int(t) for t in args.tp.split(",")} | {1})
    except ValueError:
        raise UserError(f"--tp={args.tp!r} must be comma-separated integers, e.g. 1,2,4") \
            from None
    sizes = dict(tp=tps[0], batch=args.batch, seq=args.seq, hidden=args.hidden,
                 ffn=args.ffn or 1, layers=args.layers or 1)
    bad = [f"{k}={v} must be a positive integer" for k, v in sizes.items() if v < 1]
    if bad:
        raise UserError("; ".join(bad))
    if component == "model" and args.preset:
        _refuse(get_preset(args.preset), tps, args)  # UserError naming the known presets
    return tps


def _refuse(cfg, tps: list[int], args: argparse.Namespace) -> None:
    """UserError naming the numbers, before any process starts, when the model cannot
    run at one of the tp sizes (a refusal is not a mismatch)."""
    for tp in tps:
        problems = cfg.problems(tp=tp, sp=args.sp, seq=args.seq)
        if problems:
            raise UserError(f"{cfg.name}: " + "; ".join(problems))


def _run_hf(args: argparse.Namespace) -> int:
    """--hf DIR: the model at every tp against transformers (float32), ledger vs theory."""
    config = hf_source(args.hf).config  # an unsupported family or no model folder: UserError
    ids = hf_check.sample_ids(config, args.batch, args.seq)
    tps = sorted({int(t) for t in args.tp.split(",")})
    _refuse(config, tps, args)
    print(f"tpkit verify: {args.hf} ({config.family}){' +SP' if args.sp else ''}, "
          f"batch={args.batch} seq={args.seq} {args.dtype}, tp={tps}, reference: "
          f"transformers in {args.dtype}")
    dtype = getattr(torch, args.dtype)
    ref = hf_check.reference(args.hf, ids, dtype)
    low = args.dtype in HF_UNITS  # relative differences, in units of its rounding
    rows = sweep(hf_check.tp_case, (args.hf, ids, args.sp, args.expert_parallel, dtype), tps,
                 ref, hf_check.gather, partial(hf_check.compare, relative=low), args.timeout,
                 comm_choice(getattr(args, "comm", None)))
    if not low:
        return _report(rows, tps, TOL_HF, TOL_HF, "transformers", "float32")
    u, n = HF_UNITS[args.dtype]
    return _report(rows, tps, n * u, n * u, "transformers", args.dtype,
                   f"max |Δ| / max |transformers'|: outputs, loss and gradients <= {n} "
                   f"{args.dtype} rounding units (2^{math.log2(u):.0f}) = {n * u:.3g}")


def _report(rows: list[TPResult], tps: list[int], tol: float, loss_tol: float,
            ref_name: str, dtype: str, bound: str | None = None) -> int:
    """Print each failing (and the last) tp's ledger, the table, and the verdict."""
    for r in rows:
        if r.error:
            print(r.error)
        elif r.tp == tps[-1] or not r.good(tol, loss_tol):
            print(r.table)
    ran = [r for r in rows if r.error is None]
    _print_rows(ran, tol, loss_tol, ref_name, dtype, bound)
    if not all(r.good(tol, loss_tol) for r in ran):
        print("MISMATCH")
        return 1
    if len(ran) < len(rows):  # nothing differed: some tp could not run (its error above)
        print(f"NOT RUN at tp={','.join(str(r.tp) for r in rows if r.error)}: every tp that "
              f"ran matches {ref_name}")
        return 1
    print(f"OK: every tp matches {ref_name} and the ledger matches the theory")
    return 0


def _print_rows(rows: list[TPResult], tol: float, loss_tol: float, ref_name: str,
                dtype: str, bound: str | None = None) -> None:
    loss = (f"loss <= {LOSS_ULPS} float32 ulp = {loss_tol:.2g}"
            if ref_name == "tp=1" and dtype == "float32" else f"loss {loss_tol:g}")
    bound = bound or f"max abs: outputs and gradients {tol:g}; {loss}"
    t = Table(title=f"against {ref_name} ({bound})")
    for c in ("tp", "max|Δ out|", "Δ loss", "max|Δ grad|", "max|Δ dx|", "param bytes/rank",
              "ledger vs theory", "ok"):
        t.add_column(c, justify="right")
    for r in rows:
        cells = [f"{r.diffs[k]:.2e}" if k in r.diffs else "-"
                 for k in ("out", "loss", "grads", "gx")]
        t.add_row(str(r.tp), *cells, human_bytes(r.param_bytes),
                  "matches" if not r.problems else "; ".join(r.problems)[:60],
                  "yes" if r.good(tol, loss_tol) else "NO")
    print(render(t))

