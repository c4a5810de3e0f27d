"""`tpkit train`: flags (or a TOML file) -> a run on local processes or under torchrun.

    tpkit train --preset gpt2-tiny --tp 2 --pp 2 --steps 300          # 4 local gloo processes
    torchrun --nnodes 2 --nproc_per_node 8 -m tpkit train --tp 8 --pp 2 ...   # one per GPU

Where the ranks come from is `tpkit.launch.launch`'s decision: alone, the command checks
the run folder (`_run_folder`: the policy of `tpkit.train.run_policy`, which `train()`
called from Python follows too), then spawns `--processes` (default tp*pp*dp*cp) local
gloo processes; under torchrun rank 0 checks the folder and every process runs the loop
on the mesh from the environment (tp innermost: a tp group stays on one
node; a layout that breaks that is warned about, with the reason). Configuration
errors are reported before any process starts (and again on every rank).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from tpkit.commands.common import add_knobs, deprecated_alias, group
from tpkit.commands.memory_check import check_fits
from tpkit.commands.train_continue import continue_hint, continues
from tpkit.host.device import best_device, cuda_available, device_name
from tpkit.host.elastic import restart_advice
from tpkit.host.stop import passed_on
from tpkit.launch import launch, signal_workers, world_here
from tpkit.parallel.schedules import CHUNKED
from tpkit.plan.cost import model_flops_per_token
from tpkit.plan.hardware import profile_of_device
from tpkit.plan.topology import cross_node_penalty
from tpkit.spec.errors import UserError
from tpkit.spec.grid import dp_left, locality_problem
from tpkit.spec.knobs import knobs
from tpkit.spec.shapes import default_micro_batches
from tpkit.spec.transport import add_comm_argument, comm_choice
from tpkit.spec.words import plural
from tpkit.train.config import TrainConfig
from tpkit.train.config_file import read_toml, to_toml
from tpkit.train.data import load_tokens
from tpkit.train.loop import train
from tpkit.train.report import report
from tpkit.train.run_log import report_file
from tpkit.train.run_policy import resume_dir, run_folder  # noqa: F401 (--resume's choice)
from tpkit.train.trace import merge
from tpkit.train.trackers import Trackers

if TYPE_CHECKING:
    from tpkit.train.report import RunSummary


def add_arguments(parser: argparse.ArgumentParser, cls: type | None = None) -> None:
    """The flags of `tpkit train`: one per knob of TrainConfig (or `cls`), in a group per
    section titled by its name, each help with its default; then the command's own."""
    add_knobs(parser, cls or TrainConfig)
    parser.add_argument("--config", help="TOML file, sectioned ([model], [parallelism], ...) or "
                                      "flat; the flags given override it (default: none)")
    parser.add_argument("--print-config", action="store_true",
                     help="print the effective config (defaults, --config, flags) as TOML, "
                          "checked as a run checks it, and exit")
    processes = group(parser, "parallelism").add_argument(
        "--processes", type=int, metavar="N",
        help="local processes to spawn (default: tp*pp*dp*cp; under torchrun: its own)")
    deprecated_alias(group(parser, "parallelism"), processes, "--nproc")
    add_comm_argument(group(parser, "parallelism"))
    group(parser, "checkpoint").add_argument(
        "--overwrite", action="store_true",
        help="delete the checkpoints of an earlier run in --out first")
    group(parser, "reliability").add_argument(
        "--force", action="store_true",
        help="run even when the memory estimate (weights, gradients, AdamW, activations of "
             "every local rank) is more than the machine or its cgroup offers")


def config_from_args(args: argparse.Namespace, world: int | None) -> TrainConfig:
    """TrainConfig from the TOML file (if any) overridden by the flags given."""
    names = {k.name for k in knobs(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    from_file = read_toml(args.config, TrainConfig) if getattr(args, "config", None) else {}
    cfg = TrainConfig(**{**from_file, **given})
    dp = dp_left(world, cfg.tp, cfg.pp, cfg.cp) if world else None
    if "dp" not in given and "dp" not in from_file and dp:
        cfg = cfg.with_(dp=dp)
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
    return train(cfg, mesh, trackers=trackers(cfg, mesh), folder_held=True)  # `_run_folder`


def flops_per_token(cfg: TrainConfig) -> float:
    """Training FLOPs per token of the model (the planner's formula: MFU's numerator)."""
    return model_flops_per_token(cfg.model_config(), cfg.seq)


def trackers(cfg: TrainConfig, mesh):
    """The run's trackers (`--trackers`), with MFU's numerator and, when this device has a
    known profile (a GPU the planner knows, a CPU after `tpkit calibrate`), its peak."""
    if mesh.rank != 0:
        return None

    profile = profile_of_device(device_name(mesh.device))
    peak = profile.accelerator.peak_flops * mesh.world_size if profile else None
    return Trackers(cfg, flops_per_token(cfg), peak)


def _print_report(results: list[RunSummary]) -> None:
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
    world = world_here() or args.processes
    if world is not None and world < 1:
        raise UserError(f"--processes={world} must be a positive number of processes")
    cfg = config_from_args(args, world)
    cfg.check(world or cfg.world_size)
    if args.print_config:
        print(to_toml(cfg, "the effective configuration: defaults, --config, then the flags"),
              end="")
        return 0
    mesh = dict(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, cp=cfg.cp,
                comm=comm_choice(getattr(args, "comm", None)))
    try:
        with passed_on(signal_workers):  # a first Ctrl-C: the ranks save, then stop
            results = launch(_worker, ranks=cfg.world_size, mesh=mesh, every=True,
                             setup=partial(_run_folder, cfg, args.overwrite, args.force),
                             device=best_device(),
                             collective_timeout=cfg.collective_timeout)
    except BaseException as e:  # a stop or a failure: the line says how to continue
        if continues(e):
            e.then = continue_hint(cfg.out, e)
        raise
    if results is not None:  # rank 0
        _print_report(results)
        report_file("the merged trace", _merge_trace, cfg)
    return 0


@contextmanager
def _run_folder(cfg: TrainConfig, overwrite: bool, force: bool, mesh
                ) -> Iterator[tuple[TrainConfig]]:
    """The run's folder, decided once where `launch` decides the run: in this process
    before any rank starts (mesh None: the data and the memory are checked too), or by
    rank 0 of torchrun's ranks (`train.run_policy.run_folder`: the resume chosen, the
    folder locked, another run refused or, with --overwrite, deleted, the config
    written); yields (the config with the resume chosen,)."""
    auto = cfg.resume == "auto"
    check = partial(_check_data_and_memory, force=force) if mesh is None else None
    with run_folder(cfg, mesh, overwrite, check) as cfg:
        if mesh is not None:
            _say_where(mesh, auto)
        yield (cfg,)
        if mesh is not None and mesh.rank == 0:
            print(mesh.describe())


def _say_where(mesh, resume_auto: bool) -> None:
    """Under torchrun: each rank's place, and rank 0 the planner's price of a tp group
    that spans nodes (the mesh warned of it) and what a restart would lack
    (`tpkit.host.elastic`)."""
    # one write per line: ranks share the agent's stdout, and print() under
    # PYTHONUNBUFFERED writes the text and its newline separately, so two ranks' lines
    # could run together
    sys.stdout.write(f"rank {mesh.rank}: {mesh!r}, tp group {list(mesh.tp_group.ranks)}, "
                     f"transports: {mesh.transports()}\n")
    sys.stdout.flush()
    price = cross_node_price(mesh.tp_size, mesh.pp_size, mesh.dp_size, mesh.ranks_per_node,
                             mesh.cp_size)
    for line in (price, restart_advice(resume_auto)):
        if line and mesh.rank == 0:
            print(line, file=sys.stderr, flush=True)


def _check_data_and_memory(cfg: TrainConfig, force: bool) -> None:
    """Before spawning the ranks: the data read now, and (local ranks on the CPU share
    this machine's memory) the planner's estimate of their peak against what it offers
    (`memory_check`)."""
    load_tokens(cfg.data, cfg.model_config().vocab_size, cfg.tokenizer_id)
    if not cuda_available():
        check_fits(cfg, force)


def _merge_trace(cfg: TrainConfig) -> None:
    """Every rank's part of the timeline -> one trace and its PNG (after all ranks wrote)."""
    if not cfg.trace:
        return

    title = (f"{cfg.preset} tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}, {cfg.schedule}, "
             f"{plural(cfg.micro_batches, 'micro-batch')}: the last step")
    path = merge(cfg.trace, cfg.world_size, title, png_copy=Path(cfg.out) / "trace.png")
    print(f"timeline {path} (open in ui.perfetto.dev), {path.parent / 'step.png'}")


def cross_node_price(tp: int, pp: int, dp: int, ranks_per_node: int, cp: int = 1
                     ) -> str | None:
    """The planner's price of tp groups that span nodes (`TopologyWarning` says why), or None."""
    if locality_problem(tp, pp, dp, ranks_per_node, cp) is None:
        return None
    said = cross_node_penalty(None, tp, ranks_per_node, hardware="h100")
    return f"Predicted on H100 nodes with InfiniBand: {said}" if said else None
