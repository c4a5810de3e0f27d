"""`tpkit train`: flags (or a TOML file) -> a run on local processes or under torchrun.

    tpkit train --preset gpt2-tiny --tp 2 --pp 2 --steps 300          # 4 local gloo processes
    torchrun --nnodes 2 --nproc_per_node 8 -m tpkit train --tp 8 --pp 2 ...   # one per GPU

Without RANK in the environment the command spawns `--nproc` (default tp*pp*dp)
local gloo processes with `tpkit.launch.spawn`; under torchrun every process runs
the loop on the mesh from the environment (tp innermost: a tp group stays on one
node; a layout that breaks that is warned about, with the reason). Configuration
errors are reported before any process starts (and again on every rank).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from tpkit.commands.common import HEADINGS, group, says_default, shown
from tpkit.parallel.schedules import CHUNKED, SCHEDULES
from tpkit.spec.errors import UserError
from tpkit.spec.shapes import default_micro_batches
from tpkit.spec.theory import FSDP_RESHARD
from tpkit.spec.transport import add_comm_argument, comm_choice
from tpkit.spec.words import plural
from tpkit.train.config import DTYPES, NONFINITE_POLICIES, TrainConfig
from tpkit.train.config_file import (
    read_toml,
    resume_changes,
    saved_config,
    section_of,
    to_toml,
    write_run_config,
)
from tpkit.train.run_log import report_file

if TYPE_CHECKING:
    from tpkit.train.report import RunSummary

_FLAGS = {  # field -> (type, 'store_true' or a tuple of choices; help); heading: its section
    "preset": (str, "model preset (`tpkit presets` lists them)"),
    "from_hf": (str, "fine-tune a Hugging Face model folder (its config, weights; its "
                     "tokenizer goes into the checkpoints) (default: none, the preset)"),
    "tp": (int, "tensor-parallel size"), "pp": (int, "pipeline stages"),
    "dp": (int, "data-parallel replicas (default: what the processes leave over)"),
    "steps": (int, "optimizer steps"),
    "micro_batches": (int, "micro-batches per step and replica (default: 1 at pp=1; with "
                           "pipeline stages, up to 2 per stage that divide global_batch/dp)"),
    "global_batch": (int, "sequences per step, all replicas together"),
    "seq": (int, "sequence length"), "lr": (float, "peak learning rate"),
    "min_lr": (float, "final learning rate (default: lr/10)"),
    "warmup": (int, "warmup steps"), "weight_decay": (float, "AdamW weight decay"),
    "clip": (float, "clip the global gradient norm to this (0: off)"),
    "sp": ("store_true", "sequence parallelism"),
    "zero1": ("store_true", "shard the optimizer state over dp (ZeRO-1)"),
    "zero2": ("store_true", "shard the gradients and the optimizer state over dp, weights "
                            "replicated (ZeRO-2): each micro-batch's gradients are "
                            "reduce-scattered in buckets as backward finishes them"),
    "fsdp": ("store_true", "fully sharded data parallel (ZeRO-3): weights, gradients and "
                           "optimizer state sharded over dp, one flat unit per layer, "
                           "all-gathered just before use (composes with --tp and --pp)"),
    "cp": (int, "context-parallel ranks per sequence: load-balanced chunks, ring attention "
                "(k/v passed point-to-point); the processes are tp*pp*dp*cp"),
    "fsdp_reshard": (FSDP_RESHARD, "with --fsdp, when gathered weights are freed: after-forward "
                                   "(gathered again for backward) or after-step (kept for the "
                                   "step: one gather and one reduce-scatter per step)"),
    "schedule": (tuple(SCHEDULES), "pipeline schedule"),
    "virtual_stages": (int, "model chunks per stage, for --schedule interleaved"),
    "dtype": (DTYPES, "compute dtype (bfloat16: autocast)"),
    "recompute": ("store_true", "recompute activations in backward"),
    "master_weights": ("store_true", "with --dtype bfloat16: bf16 weights and activations, fp32 "
                                     "master weights and gradient sums (Megatron's recipe)"),
    "compile": ("store_true", "torch.compile each transformer block (collectives stay eager, "
                              "as graph breaks); prints the compile time"),
    "compile_backend": (str, "torch.compile backend for --compile"),
    "loss_chunk": (int, "head + cross-entropy this many tokens at a time: the logits of the "
                        "whole micro-batch never exist (0: off)"),
    "data": (str, "text file, directory of .txt, .bin of uint16 tokens, or a `tpkit "
                  "prepare-data` folder (default: Python's own documentation, embedded)"),
    "val_fraction": (float, "held-out fraction of the data"),
    "eval_every": (int, "validation every N steps"),
    "ckpt_every": (int, "checkpoint every N steps (and always at the end; 0: only there)"),
    "out": (str, "the run folder (config.toml, metrics.jsonl, loss.png, checkpoints/, tb/)"),
    "log": (str, "experiment trackers, comma-separated: tensorboard, wandb, mlflow, trackio "
                 "(offline, under --out), or none; auto: tensorboard when it is installed"),
    "seed": (int, "seed of weights and data order"),
    "trace": (str, "write the last step's per-rank timeline here: trace.json (Perfetto / "
                   "chrome://tracing) and step.png (also copied into the run folder) "
                   "(default: none)"),
    "resume": (str, "continue from a checkpoint, or a run folder (its latest valid one); "
                    "auto: from the newest valid checkpoint in --out if there is one "
                    "(restarts) (default: none, a new run)"),
    "keep_checkpoints": (int, "newest complete checkpoints to keep (0: all)"),
    "check_replicas": (int, "every N steps, check that replicated parameters are identical "
                            "on every tp rank (0: off)"),
    "collective_timeout": (float, "seconds a collective may wait for a dead or stuck rank "
                                  "before the run stops, naming it"),
    "on_nonfinite": (NONFINITE_POLICIES, "a NaN/inf loss or gradient norm: stop the run "
                                         "(exit 1, naming the step) or skip the step's update"),
    "nonfinite_skips": (int, "with --on-nonfinite skip: stop after this many non-finite "
                             "steps in a row"),
}
_METAVARS = {"preset": "NAME", "from_hf": "DIR", "compile_backend": "NAME", "data": "PATH",
             "out": "DIR", "log": "LIST", "trace": "DIR", "resume": "PATH"}
_HEADING = {"model": "model", "parallelism": "parallelism", "training": "batch",
            "optimizer": "batch", "data": "data", "checkpoint": "checkpoints",
            "logging": "logging", "reliability": "reliability"}  # TOML section -> heading


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tpkit train` (each mirrors a TrainConfig field and TOML key), under
    the headings of `tpkit.commands.common`, each with the field's default."""
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    for key in HEADINGS:  # the headings in their order, whoever adds to them later
        group(parser, key)
    for name, (kind, text) in _FLAGS.items():
        flag, where = "--" + name.replace("_", "-"), group(parser, _HEADING[section_of(name)])
        if defaults[name] is not None and not says_default(text) and kind != "store_true":
            text += f" (default: {shown(defaults[name])})"
        if kind == "store_true":
            where.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)
        elif isinstance(kind, tuple):
            where.add_argument(flag, choices=kind, default=argparse.SUPPRESS, help=text)
        else:
            where.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text,
                               metavar=_METAVARS.get(name, "N" if kind is int else "X"))
    parser.add_argument("--config", help="TOML file, sectioned ([model], [parallelism], ...) or "
                                      "flat; the flags given override it (default: none)")
    parser.add_argument("--print-config", action="store_true",
                     help="print the effective config (defaults, --config, flags) as TOML "
                          "and exit")
    group(parser, "parallelism").add_argument(
        "--nproc", type=int, help="local processes to spawn (default: tp*pp*dp)")
    add_comm_argument(group(parser, "parallelism"))
    group(parser, "logging").add_argument("--no-progress", action="store_true",
                                          help="no progress bar")
    group(parser, "checkpoints").add_argument(
        "--overwrite", action="store_true",
        help="delete the checkpoints of an earlier run in --out first")
    group(parser, "reliability").add_argument(
        "--force", action="store_true",
        help="run even when the memory estimate (weights, gradients, AdamW, activations of "
             "every local rank) is more than the machine or its cgroup offers")


def config_from_args(args: argparse.Namespace, world: int | None) -> TrainConfig:
    """TrainConfig from the TOML file (if any) overridden by the flags given."""
    names = {f.name for f in fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if getattr(args, "no_progress", False):
        given["progress"] = False
    from_file = read_toml(args.config, names) if getattr(args, "config", None) else {}
    cfg = TrainConfig(**{**from_file, **given})
    rest = cfg.tp * cfg.pp * cfg.cp
    if "dp" not in given and "dp" not in from_file and world and world % rest == 0:
        cfg = cfg.with_(dp=world // rest)
    if "micro_batches" not in given and "micro_batches" not in from_file:
        cfg = cfg.with_(micro_batches=_default_micro_batches(cfg))
    return cfg


def _default_micro_batches(cfg: TrainConfig) -> int:
    """What the pipeline needs (`spec.shapes.default_micro_batches`); 1 when the batch
    does not divide over dp (the config's check then says so)."""
    sizes = (cfg.pp, cfg.dp, cfg.global_batch)
    if not all(isinstance(n, int) and n > 0 for n in sizes) or cfg.global_batch % cfg.dp:
        return 1
    return default_micro_batches(cfg.pp, cfg.global_batch // cfg.dp, cfg.schedule == CHUNKED)


def _worker(mesh, cfg: TrainConfig) -> RunSummary:
    from tpkit.train.loop import train

    return train(cfg, mesh, trackers=trackers(cfg, mesh))


def flops_per_token(cfg: TrainConfig) -> float:
    """Training FLOPs per token of the model (the planner's formula: MFU's numerator)."""
    from tpkit.plan.cost import model_flops_per_token

    return model_flops_per_token(cfg.model_config(), cfg.seq)


def trackers(cfg: TrainConfig, mesh):
    """The run's trackers (`--log`), with MFU's numerator and, when this device has a
    known profile (a GPU the planner knows, a CPU after `tpkit calibrate`), its peak."""
    from tpkit.plan.hardware import profile_of_device
    from tpkit.train.trackers import Trackers

    if mesh.rank != 0:
        return None
    from tpkit.host.device import device_name

    profile = profile_of_device(device_name(mesh.device))
    peak = profile.accelerator.peak_flops * mesh.world_size if profile else None
    return Trackers(cfg, flops_per_token(cfg), peak)


def _print_report(results: list[RunSummary]) -> None:
    from tpkit.train.report import report

    first = results[0]
    last = next((r for r in results if r.stage == first.config.pp - 1 and r.tp_rank == 0),
                None)
    tables = [first.table, first.theory]
    if last is not None and last is not first:
        tables.append(last.theory)
    print(report(first, tables))


def run(args: argparse.Namespace) -> int:
    """Train; 0 on success. A configuration, data or checkpoint error raises UserError
    (one line on stderr and exit status 2, from `tpkit.cli`), before any process starts."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc
    if world is not None and world < 1:
        raise UserError(f"--nproc={world} must be a positive number of processes")
    cfg = config_from_args(args, world)
    if args.print_config:
        print(to_toml(cfg, "the effective configuration: defaults, --config, then the flags"),
              end="")
        return 0
    cfg.check(world or cfg.world_size)
    fresh = not cfg.resume  # "auto" with nothing to resume is no fresh run either
    cfg = cfg.with_(resume=resume_dir(cfg))  # chosen once, here
    _say_resume_changes(cfg)
    comm = comm_choice(getattr(args, "comm", None))
    if torchrun:
        return _run_torchrun(cfg, args.overwrite, comm, fresh)
    from tpkit.train.data import load_tokens
    from tpkit.train.run_folder import check_writable, hold

    check_writable(Path(cfg.out))  # one line, before any process is spawned
    with hold(Path(cfg.out)):  # one run per folder, from here until the run ends
        if fresh:
            _never_mix_runs(Path(cfg.out), args.overwrite, torchrun)
        load_tokens(cfg.data, cfg.model_config().vocab_size, cfg.tokenizer_id)  # errors now
        _check_memory(cfg, args.force)
        write_run_config(cfg, cfg.out)
        return _run_local(cfg, comm)


def _check_memory(cfg: TrainConfig, force: bool) -> None:
    """Local ranks on the CPU share this machine's memory: the planner's estimate of
    their peak against what it offers (`memory_check`), before spawning them."""
    from tpkit.host.device import cuda_available

    if not cuda_available():
        from tpkit.commands.memory_check import check_fits

        check_fits(cfg, force)


def resume_dir(cfg: TrainConfig) -> str | None:
    """The checkpoint directory `cfg.resume` names: "auto", the newest valid one in
    --out (None: a fresh run); a run folder, its latest valid checkpoint."""
    from tpkit.checkpoint.paths import latest, run_checkpoints, sharded_dir

    if cfg.resume == "auto":
        found = latest(run_checkpoints(cfg.out))
        return None if found is None else str(found)
    return cfg.resume and str(sharded_dir(cfg.resume))


def _say_resume_changes(cfg: TrainConfig) -> None:
    """A resumed run (`cfg.resume`: the checkpoint directory `resume_dir` chose): print
    what differs from the checkpoint's config; a change that cannot work (another model,
    another data order) is a UserError."""
    saved = saved_config(cfg.resume) if cfg.resume else None
    if saved is None:
        return
    changes = resume_changes(saved, cfg)  # raises on every rank
    if changes and os.environ.get("RANK", "0") == "0":
        print(f"resuming {cfg.resume} with changes: " + "; ".join(changes), file=sys.stderr)


def _never_mix_runs(out: Path, overwrite: bool, torchrun: bool) -> None:
    """A new run into an --out that holds an earlier run's checkpoints: refuse, naming
    the flags, or (--overwrite) delete them first (rank 0 only, under torchrun)."""
    from tpkit.checkpoint.paths import run_checkpoints
    from tpkit.checkpoint.retention import complete, discard

    found = complete(run_checkpoints(out))
    if not found:
        return
    if not overwrite:
        raise UserError(f"--out {out} holds an earlier run (checkpoints up to "
                        f"{found[-1].name}); continue it with --resume {out}, start over "
                        f"with --overwrite, or choose another --out")
    if not torchrun or os.environ.get("RANK") == "0":
        for d in found:
            discard(d)


def _run_local(cfg: TrainConfig, comm: str) -> int:
    from tpkit.host.device import best_device
    from tpkit.launch import spawn
    from tpkit.mesh import ParallelMesh

    n = cfg.world_size
    if n == 1:  # one process: on the GPU when there is one
        results = [_worker(ParallelMesh.single(device=best_device()), cfg)]
    else:
        threads = max(1, (os.cpu_count() or 1) // n)
        results = spawn(_worker, n, cfg, mesh=dict(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp * cfg.cp,
                                                   comm=comm),
                        threads=threads, timeout=7 * 24 * 3600.0,
                        collective_timeout=cfg.collective_timeout)
    _print_report(results)
    report_file("the merged trace", _merge_trace, cfg)
    return 0


def _merge_trace(cfg: TrainConfig) -> None:
    """Every rank's part of the timeline -> one trace and its PNG (after all ranks wrote)."""
    if not cfg.trace:
        return
    from tpkit.train.trace import merge

    title = (f"{cfg.preset} tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}, {cfg.schedule}, "
             f"{plural(cfg.micro_batches, 'micro-batch')}: the last step")
    path = merge(cfg.trace, cfg.world_size, title, png_copy=Path(cfg.out) / "trace.png")
    print(f"timeline {path} (open in ui.perfetto.dev), {path.parent / 'step.png'}")


def cross_node_price(tp: int, pp: int, dp: int, ranks_per_node: int) -> str | None:
    """The planner's price of tp groups that span nodes (`TopologyWarning` says why), or None."""
    from tpkit.plan.topology import cross_node_penalty
    from tpkit.spec.grid import locality_problem

    if locality_problem(tp, pp, dp, ranks_per_node) is None:
        return None
    said = cross_node_penalty(None, tp, ranks_per_node, hardware="h100")
    return f"Predicted on H100 nodes with InfiniBand: {said}" if said else None


@contextmanager
def _folder_held_by_rank0(out: Path, rank: int) -> Iterator[None]:
    """Under torchrun: rank 0 checks and locks --out; every rank learns its verdict (one
    broadcast) and raises the same line, so no rank starts while another refused."""
    import torch.distributed as dist

    from tpkit.train.run_folder import check_writable, hold

    with ExitStack() as stack:
        said = [None]
        if rank == 0:
            try:
                check_writable(out)
                stack.enter_context(hold(out))
            except UserError as e:
                said = [str(e)]
        dist.broadcast_object_list(said, src=0)
        if said[0] is not None:
            raise UserError(said[0])
        yield


def _run_torchrun(cfg: TrainConfig, overwrite: bool, comm: str, fresh: bool) -> int:
    from tpkit.mesh import ParallelMesh

    mesh = ParallelMesh.from_env(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp * cfg.cp,  # cp: in dp
                                 timeout_s=cfg.collective_timeout, comm=comm)
    with _folder_held_by_rank0(Path(cfg.out), mesh.rank):
        if fresh:
            _never_mix_runs(Path(cfg.out), overwrite, True)
        if mesh.rank == 0:
            write_run_config(cfg, cfg.out)
        return _train_torchrun(cfg, mesh)


def _train_torchrun(cfg: TrainConfig, mesh) -> int:
    import torch.distributed as dist

    from tpkit.train.loop import train

    # one write per line: ranks share the agent's stdout, and print() under PYTHONUNBUFFERED
    # writes the text and its newline separately, so two ranks' lines could run together
    sys.stdout.write(f"rank {mesh.rank}: {mesh!r}, tp group {list(mesh.tp_group.ranks)}\n")
    sys.stdout.flush()
    price = cross_node_price(mesh.tp_size, mesh.pp_size, mesh.dp_size, mesh.ranks_per_node)
    if price and mesh.rank == 0:  # the mesh warned of the problem; the planner prices it
        print(price, file=sys.stderr, flush=True)
    result = train(cfg, mesh, trackers=trackers(cfg, mesh))
    if mesh.rank == 0:
        print(mesh.describe())
        _print_report([result])
    dist.barrier()
    if mesh.rank == 0:
        report_file("the merged trace", _merge_trace, cfg)
    dist.destroy_process_group()
    return 0
