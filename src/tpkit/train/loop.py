"""The training run: prepare, build, resume, then `cfg.steps` steps (`train.step`),
metrics, checkpoints, the summary.

    loader, val = prepare(cfg, mesh)       every check that can fail, before a collective
    model = train_model(cfg, mesh)         preset or Hugging Face weights (one builder)
    data_parallel = ReplicatedData | ...  dp: plain / ZeRO-1, or ZeRO-2 / FSDP
    ctx = StepContext(...)                 what a step needs, once
    for each step: run_step(ctx, loader, step), evaluate, save_checkpoint (every
        --ckpt-every steps, --ckpt-minutes, or at a stop signal: `_Boundary`)

Every rank runs this same function; rank 0 writes the metrics, the plot and the
report. Checkpoints use `tpkit.checkpoint.store.save` (sharded, reshardable).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from tpkit.checkpoint import retention, store
from tpkit.checkpoint.rng import capture_rng, restore_rng
from tpkit.comm import all_reduce
from tpkit.comm.failure import CollectiveFailed
from tpkit.host import stop
from tpkit.host.exit import Stopped
from tpkit.mesh import ParallelMesh
from tpkit.parallel import StageLink, context, ring_backward_group, tied_embedding_group
from tpkit.parallel.divergence import check_replicas
from tpkit.parallel.replicated_data import ReplicatedData
from tpkit.spec import theory
from tpkit.spec.errors import UserError
from tpkit.train import run_log, trace
from tpkit.train.config import TrainConfig
from tpkit.train.data import (
    TokenLoader,
    assistant_mask,
    load_tokens,
    split_tokens,
    tokenizer_folder,
)
from tpkit.train.master import MasterWeights
from tpkit.train.nonfinite import NonFiniteGuard
from tpkit.train.optim import build_optimizer, build_sharding
from tpkit.train.report import RunSummary, sharded_rows, theory_rows, theory_table
from tpkit.train.run_policy import run_folder
from tpkit.train.step import StepContext, evaluate, run_step
from tpkit.train.trackers import Trackers
from tpkit.weights.build import build_model
from tpkit.weights.paths import step_dir
from tpkit.weights.sources import open_source


def prepare(cfg: TrainConfig, mesh: ParallelMesh) -> tuple[TokenLoader, TokenLoader | None]:
    """Every check that can fail, before any collective: config, layout, data."""
    cfg.check(mesh.world_size)
    got = (mesh.tp_size, mesh.pp_size, mesh.dp_size, mesh.cp_size)
    if got != (cfg.tp, cfg.pp, cfg.dp, cfg.cp):
        raise ValueError(f"mesh (tp, pp, dp, cp) = {got} does not match the config "
                         f"{(cfg.tp, cfg.pp, cfg.dp, cfg.cp)}")
    tokens = load_tokens(cfg.data, cfg.model_config().vocab_size, cfg.tokenizer_id,
                         warn=mesh.rank == 0)  # every rank checks; one says a warning
    train_tok, val_tok = split_tokens(tokens, cfg.val_fraction, window=cfg.seq + 1)
    masks = split_tokens(assistant_mask(cfg.data), cfg.val_fraction, window=cfg.seq + 1) \
        if cfg.loss_on == "assistant" else (None, None)  # cut as the tokens are
    split = (f" (of {len(tokens):,} tokens, {len(train_tok):,} for training and "
             f"{len(val_tok):,} held out by --val-fraction {cfg.val_fraction})")
    kw = dict(seq=cfg.seq, global_batch=cfg.global_batch, dp_rank=mesh.dp_rank,
              dp_size=mesh.dp_size, seed=cfg.seed, split=split)  # a replica's cp ranks: same rows
    loader = TokenLoader(train_tok, **kw, name="training", mask=masks[0])
    val = TokenLoader(val_tok, **kw, shuffle=False, name="validation", min_windows=1,
                      mask=masks[1]) \
        if cfg.val_fraction > 0 else None
    return loader, val


def train_model(cfg: TrainConfig, mesh: ParallelMesh,
                dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model (preset, or Hugging Face folder), this rank's stage and shard of it
    (`weights.build.build_model`, the one builder), built complete: ring attention
    over the mesh's cp group, compiled blocks with `compile`.

    With `from_hf` each rank reads only its slices of the folder's weights (unless it
    resumes: the checkpoint's weights replace them anyway). With `dtype` (the bf16
    compute copy of master weights) its weights are left to `MasterWeights`."""
    hf = cfg.from_hf is not None and not cfg.resume and dtype is None
    model = build_model(cfg.model_config(), mesh, open_source(cfg.from_hf) if hf else None,
                        seed=cfg.seed, sequence_parallel=cfg.sp, recompute=cfg.recompute,
                        virtual_stages=cfg.virtual_stages, loss_chunk=cfg.loss_chunk,
                        dtype=dtype, compile_backend=cfg.compile_backend if cfg.compile else None)
    return model


def build_context(cfg: TrainConfig, mesh: ParallelMesh, model: torch.nn.Module,
                  loader: TokenLoader) -> tuple[StepContext, object | None, int]:
    """(the StepContext of this run, its ZeRO-2 / FSDP sharding or None, the first step):
    optimizer, dp protocol, pipeline link, resumed state, master weights."""
    tied = tied_embedding_group(mesh, model.config.tie_embeddings)
    cp_group = mesh.cp_group if mesh.cp_size > 1 else None  # each rank its s/cp tokens
    sharding = build_sharding(model, cfg, mesh)  # ZeRO-2 / FSDP (tpkit.parallel.sharded)
    opt = sharding.optimizer if sharding else build_optimizer(model, cfg, mesh)
    data_parallel = sharding or ReplicatedData(model, mesh, opt, cfg.micro_batches)
    between_stages = torch.bfloat16 if cfg.master_weights else torch.float32  # the dtype
    # gradients travel on their own communicator (see tpkit.parallel.p2p)
    link = StageLink(mesh.pp_group, device=mesh.device, dtype=between_stages,
                     backward_group=ring_backward_group(mesh))
    with data_parallel.full_params():
        start = resume(cfg, mesh, model, opt, loader) if cfg.resume else 0
    mixed = MasterWeights(model, train_model(cfg, mesh, between_stages).train()) \
        if cfg.master_weights else None  # forward/backward in bf16, the rest on fp32 masters
    autocast = torch.autocast(mesh.device.type, dtype=torch.bfloat16) \
        if cfg.dtype == "bfloat16" and not mixed else None
    ctx = StepContext(cfg, mesh, data_parallel.stage_model(model), link, opt, data_parallel,
                      tied, mixed, autocast,
                      NonFiniteGuard(cfg.on_nonfinite, cfg.nonfinite_skips), cp_group)
    return ctx, sharding, start


def train(cfg: TrainConfig, mesh: ParallelMesh, model: torch.nn.Module | None = None,
          trackers: Trackers | None = None, *, overwrite: bool = False,
          folder_held: bool = False) -> RunSummary:
    """Run `cfg.steps` steps on this rank; returns the run's summary (same on all ranks).
    Rank 0 logs each step to `trackers` (default: those of `cfg.log`). A first SIGINT or
    SIGTERM (`tpkit.host.stop`) ends the run at the next step boundary, every rank
    agreeing: a checkpoint there, then `Stopped` saying which.

    `cfg.out` is held for the run as `tpkit train` holds it (`run_policy.run_folder`:
    `resume="auto"` resolved, the folder locked, another run's folder refused, or its
    checkpoints deleted with `overwrite`), unless the caller holds it (`folder_held`:
    the command's launcher did)."""
    with stop.honoured(), ExitStack() as stack:
        if not folder_held:
            cfg.check(mesh.world_size)  # a wrong config: refused before the folder is touched
            cfg = stack.enter_context(run_folder(cfg, mesh, overwrite))
        return _train(cfg, mesh, model, trackers)


def _train(cfg: TrainConfig, mesh: ParallelMesh, model: torch.nn.Module | None,
           trackers: Trackers | None) -> RunSummary:
    loader, val_loader = prepare(cfg, mesh)
    model = model or train_model(cfg, mesh)
    model.train()
    ctx, sharding, start = build_context(cfg, mesh, model, loader)
    opt, data_parallel, link = ctx.opt, ctx.data_parallel, ctx.link
    out, lead = Path(cfg.out), mesh.rank == 0
    run_id = run_identity(cfg) if lead else None  # only rank 0 writes manifests
    log = run_log.MetricsLog(out / "metrics.jsonl" if lead else None, resume_step=start,
                             trackers=(trackers or Trackers(cfg)) if lead else None)
    bar = run_log.Progress(cfg.steps, lead and cfg.progress)
    rows, ckpt, tokens_per_step = [], None, cfg.global_batch * cfg.seq
    train_s = idle = busy = 0.0
    boundary = _Boundary(cfg, mesh)
    try:
        for step in range(start, cfg.steps):
            mesh.ledger.clear()
            t_step = time.perf_counter()
            row = run_step(ctx, loader, step)
            span = (t_step, time.perf_counter())
            if cfg.check_replicas and (step + 1) % cfg.check_replicas == 0:
                with mesh.ledger.paused(), data_parallel.full_params():  # not part of the theory
                    check_replicas(model, mesh.tp_group, step + 1)  # FSDP: gathered first
            train_s += row["step_s"]
            if step > start or cfg.steps == start + 1:
                idle, busy = idle + row["idle_s"], busy + row["step_s"] - row["idle_s"]
            last_records = list(mesh.ledger.records)
            row["tokens_per_s"] = tokens_per_step / row["step_s"]
            row["comm_line"] = run_log.comm_line(row["comm"])
            if val_loader is not None and _due(step, cfg.eval_every, cfg.steps):
                row["val_loss"] = evaluate(ctx, val_loader)
            rows.append(row)  # logged before the checkpoint: a resume from it finds the row
            log.write({k: v for k, v in row.items() if k != "comm_line"})
            bar.update(row)
            signum, due = boundary(step + 1, row["step_s"])
            if due:
                with data_parallel.full_params():
                    ckpt = save_checkpoint(cfg, mesh, model, opt, loader, step + 1, run_id)
                boundary.since = time.monotonic()
            if signum and step + 1 < cfg.steps:
                raise Stopped(signum, f": saved step {step + 1} in {ckpt}" if due else
                              f" after step {step + 1}: not saved (--no-checkpoint)")
    except CollectiveFailed as e:  # a dead or stuck peer: say how far the run got
        raise e.after_step(start + len(rows), mesh.hosts) from e.__cause__
    finally:
        bar.close()
        log.close()
        _close_link(link, sys.exc_info()[1] is not None, start + len(rows), mesh.hosts)
    if cfg.checkpoint:
        try:
            with data_parallel.full_params():
                ckpt = save_checkpoint(cfg, mesh, model, opt, loader, cfg.steps, run_id)
        except CollectiveFailed as e:  # a peer died in the final save: every step was done
            raise e.after_step(start + len(rows), mesh.hosts) from e.__cause__
    mesh.ledger.records[:] = last_records
    if cfg.trace:
        run_log.report_file("the trace", _write_trace, cfg, mesh, last_records, span)
    return _summary(ctx, model, rows, (train_s, idle, busy), ckpt, sharding)


def _write_trace(cfg: TrainConfig, mesh: ParallelMesh, records, span) -> None:
    """This rank's timeline of the last step (`tpkit.train.trace`; merged by the command)."""
    cp = f", cp {mesh.cp_rank}" if mesh.cp_size > 1 else ""
    title = f"rank {mesh.rank} (pp {mesh.pp_rank}, tp {mesh.tp_rank}, dp {mesh.dp_rank}{cp})"
    trace.write_rank(cfg.trace, mesh.rank, title, trace.step_events(records, *span, mesh.rank))


def _close_link(link: StageLink, failing: bool, steps_done: int, hosts: list[str] | None
                ) -> None:
    """Wait for the last pipeline sends. When the run is already failing, a dead peer
    surfacing here again must not replace the error that says how far the run got."""
    try:
        link.close()
    except CollectiveFailed as e:
        if not failing:
            raise e.after_step(steps_done, hosts) from e.__cause__


CKPT_EVERY = TrainConfig.__dataclass_fields__["ckpt_every"].default  # --no-checkpoint
# alone writes none; with another --ckpt-every, only those (the old scripts' meaning)
AGREE_S = 0.2  # at most ~5 agreements a second: their latency (a tiny all-reduce, under
# a millisecond) stays a fraction of a percent of any step


class _Boundary:
    """At the end of each step: (the stop signal a rank got, or 0; whether to checkpoint
    now), the same on every rank. The step interval is every rank's to count; a stop
    (`tpkit.host.stop`), rank 0's clock (--ckpt-minutes since `since`, the last
    checkpoint) and the slowest rank's step time are agreed by one all-reduce (max) over
    every rank, outside the ledger's theory, every `every` steps: every step when steps
    take over AGREE_S, else every ceil(AGREE_S / step) (a stop then waits that long)."""

    def __init__(self, cfg: TrainConfig, mesh: ParallelMesh) -> None:
        self.cfg, self.mesh, self.since, self.every = cfg, mesh, time.monotonic(), 1

    def __call__(self, done: int, step_s: float) -> tuple[int, bool]:
        cfg, signum, late = self.cfg, 0, False
        if done % self.every == 0:
            late = cfg.ckpt_minutes > 0 and self.mesh.rank == 0 and \
                time.monotonic() - self.since >= 60 * cfg.ckpt_minutes
            signum, late, slowest = agree(self.mesh, [stop.asked(), late, step_s])
            self.every = max(1, math.ceil(AGREE_S / max(slowest, 1e-6)))
        every = cfg.ckpt_every if cfg.checkpoint or cfg.ckpt_every != CKPT_EVERY else 0
        by_steps = every > 0 and done % every == 0
        due = by_steps or cfg.checkpoint and bool(signum or late)
        return int(signum), done < cfg.steps and due


def agree(mesh: ParallelMesh, values: list[float]) -> list[float]:
    """Each value's maximum over every rank (float32), outside the ledger's theory."""
    flags = torch.tensor([float(v) for v in values], device=mesh.device)
    if mesh.world_size > 1:
        every_rank = mesh.extra_group("boundary", "world", [tuple(range(mesh.world_size))])
        with mesh.ledger.paused():
            all_reduce(flags, every_rank, "max", phase="metrics", scope="checkpoint")
    return flags.tolist()


def _due(step: int, every: int, steps: int) -> bool:
    return step + 1 == steps or (every > 0 and (step + 1) % every == 0)


def run_identity(cfg: TrainConfig) -> str:
    """This run's id, in every checkpoint it writes: the resumed checkpoint's run's
    (`retention.run_of`), or a new one."""
    return (retention.run_of(cfg.resume) if cfg.resume else None) or retention.new_run_id()


def save_checkpoint(cfg: TrainConfig, mesh: ParallelMesh, model, opt, loader: TokenLoader,
                    step: int, run_id: str | None = None) -> str:
    """Sharded checkpoint at out/checkpoints/step_N: weights, AdamW (or ZeRO-1) state,
    and in `extra` the loader position, the step and this rank's generator states;
    then retention, of this run's (`run_id`) checkpoints only."""
    path = step_dir(cfg.out, step)
    rng = dict(capture_rng(mesh.device), tp=model.rng.state, device=mesh.device.type)
    store.save(path, model, opt, step=step, mesh=mesh, run=run_id,
               extra=dict(loader=loader.state_dict(), step=step, rng=rng,
                          config=cfg.to_dict()),
               tokenizer=cfg.from_hf or tokenizer_folder(cfg.data))  # for generate, export
    if mesh.rank == 0:  # the new one is complete: only now may the oldest go
        retention.prune(path.parent, cfg.keep_checkpoints, run=run_id, current=path)
    return str(path)


def resume(cfg: TrainConfig, mesh: ParallelMesh, model, opt, loader: TokenLoader) -> int:
    """Load weights, optimizer state, loader position and generators from `cfg.resume`
    (a checkpoint directory: `run_policy.resume_dir` chose it);
    returns the next step (the learning rate follows from it: `lr_at(step)`).

    At another layout `load` returns rank 0's extra: its default generator goes to every
    rank (tp ranks must draw alike), the per-tp-rank dropout generator keeps its seed;
    on another kind of device (a GPU checkpoint on CPU) the generators keep theirs.
    """
    path = cfg.resume
    extra = store.load(path, model, opt, mesh=mesh)
    if int(extra["step"]) >= cfg.steps:
        raise UserError(f"{path} is at step {extra['step']}: nothing left to do for "
                         f"steps={cfg.steps}")
    loader.load_state_dict(extra["loader"])
    if extra.get("rng", {}).get("device") == mesh.device.type:
        restore_rng(extra["rng"], mesh.device)
        if extra["layout"] == mesh.layout:  # this rank's own extra: its own generator
            model.rng.state = extra["rng"]["tp"]
    return int(extra["step"])


def _summary(ctx: StepContext, model, rows: list[dict], times: tuple[float, float, float],
             ckpt: str | None, sharding=None) -> RunSummary:
    """Per-rank result: losses, throughput, bubble, this rank's comm table vs theory
    (`times`: seconds in steps, idle and busy seconds after the first step)."""
    cfg, mesh = ctx.cfg, ctx.mesh
    train_s, idle, busy = times
    ratio = torch.tensor([idle / busy if busy > 0 else 0.0], dtype=torch.float64,
                         device=mesh.device)
    with mesh.ledger.paused():
        all_reduce(ratio, mesh.pp_group, phase="metrics", scope="metrics")
    tables, rows_t = _theory_tables(cfg, mesh, model, sharding)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    plot = None
    if mesh.rank == 0 and cfg.plot:
        plot = run_log.report_file("loss.png", run_log.plot_losses, rows,
                                   Path(cfg.out) / "loss.png",
                                   f"{cfg.model_name} tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}")
        plot = str(plot) if plot else None
    tail = min(10, len(rows))
    return RunSummary(
        config=cfg, rank=mesh.rank, stage=mesh.pp_rank, tp_rank=mesh.tp_rank,
        hidden=model.config.hidden, micro_batch=cfg.micro_batch_size,
        losses=[r["loss"] for r in rows], grad_norms=[r["grad_norm"] for r in rows],
        first_step=rows[0]["step"], tail=tail,
        tail_loss=sum(r["loss"] for r in rows[-tail:]) / tail, val_loss=val[-1] if val else None,
        tokens_per_s=len(rows) * cfg.global_batch * cfg.seq / train_s, seconds=train_s,
        bubble=ratio.item() / mesh.pp_size,
        bubble_theory=theory.bubble_theory(mesh.pp_size, cfg.micro_batches, model.virtual_stages),
        max_inflight=max(r["max_inflight"] for r in rows),
        table=mesh.ledger.table(f"{_where(mesh)}: everything sent in one step", by_scope=False),
        theory=tables,
        theory_ok=all(r["recorded"] == r["theory"] for r in rows_t), checkpoint=ckpt,
        metrics=str(Path(cfg.out) / "metrics.jsonl"), plot=plot, first_step_s=rows[0]["step_s"],
        later_step_s=statistics.median(r["step_s"] for r in rows[1:]) if len(rows) > 1 else 0.0)


def _where(mesh: ParallelMesh) -> str:
    return f"rank {mesh.rank} (stage {mesh.pp_rank}, tp rank {mesh.tp_rank})"


def _theory_tables(cfg: TrainConfig, mesh: ParallelMesh, model, sharding
                   ) -> tuple[str, list[dict]]:
    """This rank's tp/pp traffic of the last step against `spec.theory` (and with ZeRO-2
    / FSDP its dp traffic): the tables' text and their rows."""
    b, s = cfg.micro_batch_size, cfg.seq // cfg.cp  # context parallelism: s/cp per rank
    expects = theory.stage_step(b=b, s=s, h=model.config.hidden,
                                tp=mesh.tp_size, pp=mesh.pp_size,
                                num_layers=len(model.layer_range),
                                micro_batches=cfg.micro_batches, sp=cfg.sp,
                                first=model.is_first_stage, last=model.is_last_stage,
                                chunks=model.virtual_stages,
                                recompute="full" if cfg.recompute else "none",
                                loss_chunk=model.loss_chunk, tp_rank=mesh.tp_rank,
                                embedding_trains=not model.config.lora_rank)
    rows = theory_rows(mesh.ledger, expects)
    tables = theory_table(rows, f"{_where(mesh)}: tp/pp traffic of one step vs theory")
    if sharding:  # the dp traffic of ZeRO-2 / FSDP against tpkit.spec.theory
        rows_dp = sharded_rows(mesh.ledger, sharding.expected(), sharding.scope,
                               mesh.dp_cp_group.name)
        tables += "\n" + theory_table(rows_dp, f"{_where(mesh)}: {sharding.scope} dp traffic "
                                              f"of one step vs theory")
        rows = rows + rows_dp
    if cfg.cp > 1:  # the ring attention's hops on the cp group
        rows_cp = sharded_rows(mesh.ledger, context.expected(
            model, b, s, cfg.cp, cfg.micro_batches, "full" if cfg.recompute else "none"),
            "context_parallel", "cp")
        tables += "\n" + theory_table(rows_cp, f"{_where(mesh)}: ring attention (cp) vs theory")
        rows = rows + rows_cp
    return tables, rows
