"""The training loop: one step = pipeline schedule, gradient sums, clip, AdamW.

    for each step:
      batch of this dp replica -> m micro-batches -> GPipe / 1F1B / interleaved 1F1B
                                      dp: buckets all-reduced over replicas as the last
                                          backward finishes them (OverlappedGradSync);
                                          ZeRO-1: none here, see reduce_gradients below
      model.finalize_grads()          tp: sequence-parallel norms, shared kv heads
      sync_tied_grads                 pp: embedding (first stage) + head (last stage)
      optimizer.reduce_gradients()    ZeRO-1: reduce-scatter over dp (each rank its slice)
      (all of these are sums, so their order does not change the result)
      global_grad_norm -> clip        every parameter counted once (tp, pp; not dp)
      optimizer.step()                AdamW, or ZeRO-1 (slice update + all-gather over dp)

Every rank runs this same function; rank 0 writes the metrics, the plot and the
report. Checkpoints use `tpkit.checkpoint.store.save` (sharded, reshardable).
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from tpkit.comm import all_reduce
from tpkit.comm.failure import CollectiveFailed
from tpkit.mesh import ParallelMesh
from tpkit.parallel import (
    OverlappedGradSync,
    StageLink,
    ZeroAdamW,
    clip_grads,
    context,
    forward_only,
    global_grad_norm,
    ring_backward_group,
    run_schedule,
    sync_tied_grads,
    tied_embedding_group,
)
from tpkit.parallel.replicas import check_replicas
from tpkit.spec import theory
from tpkit.spec.errors import UserError
from tpkit.train import run_log
from tpkit.train.config import TrainConfig
from tpkit.train.data import (
    TokenLoader,
    load_tokens,
    micro_batches,
    split_tokens,
    tokenizer_folder,
)
from tpkit.train.master import MasterWeights
from tpkit.train.nonfinite import NonFiniteGuard
from tpkit.train.optim import build_optimizer, build_sharding, lr_at, set_lr
from tpkit.train.report import RunSummary, sharded_rows, theory_rows, theory_table
from tpkit.train.trackers import Trackers


def prepare(cfg: TrainConfig, mesh: ParallelMesh) -> tuple[TokenLoader, TokenLoader | None]:
    """Every check that can fail, before any collective: config, layout, data."""
    cfg.check(mesh.world_size)
    got = (mesh.tp_size, mesh.pp_size, mesh.dp_size)
    if got != (cfg.tp, cfg.pp, cfg.dp * cfg.cp):  # cp ranks sit in the mesh's dp dimension
        raise ValueError(f"mesh (tp, pp, dp) = {got} does not match the config "
                         f"{(cfg.tp, cfg.pp, cfg.dp * cfg.cp)} (tp, pp, dp*cp)")
    tokens = load_tokens(cfg.data, cfg.model_config().vocab_size, cfg.tokenizer_id,
                         warn=mesh.rank == 0)  # every rank checks; one says a warning
    train_tok, val_tok = split_tokens(tokens, cfg.val_fraction, window=cfg.seq + 1)
    split = (f" (of {len(tokens):,} tokens, {len(train_tok):,} for training and "
             f"{len(val_tok):,} held out by --val-fraction {cfg.val_fraction})")
    kw = dict(seq=cfg.seq, global_batch=cfg.global_batch, dp_rank=mesh.dp_rank // cfg.cp,
              dp_size=cfg.dp, seed=cfg.seed, split=split)  # a replica's cp ranks: same rows
    loader = TokenLoader(train_tok, **kw, name="training")
    val = TokenLoader(val_tok, **kw, shuffle=False, name="validation", min_windows=1) \
        if cfg.val_fraction > 0 else None
    return loader, val


def train_model(cfg: TrainConfig, mesh: ParallelMesh,
                dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model (preset, or Hugging Face folder), this rank's stage and shard of it
    (`checkpoint.build.build_model`, the one builder).

    With `from_hf` each rank reads only its slices of the folder's weights (unless it
    resumes: the checkpoint's weights replace them anyway). With `dtype` (the bf16
    compute copy of master weights) its weights are left to `MasterWeights`."""
    from tpkit.checkpoint.build import build_model
    from tpkit.checkpoint.sources import open_source

    hf = cfg.from_hf is not None and not cfg.resume and dtype is None
    model = build_model(cfg.model_config(), mesh, open_source(cfg.from_hf) if hf else None,
                        seed=cfg.seed, sequence_parallel=cfg.sp, recompute=cfg.recompute,
                        virtual_stages=cfg.virtual_stages, loss_chunk=cfg.loss_chunk,
                        dtype=dtype)
    if cfg.compile:
        from tpkit.model.compile import compile_blocks

        compile_blocks(model, cfg.compile_backend)
    return model


def replica_mean(value: float | None, mesh: ParallelMesh) -> float:
    """The last stage's value, averaged over dp replicas, known on every rank."""
    t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64,
                     device=mesh.device)
    if mesh.tp_rank != 0:
        t.zero_()  # every tp rank of the last stage holds it; count one
    all_reduce(t, mesh.mp_group, phase="metrics", scope="metrics")
    all_reduce(t, mesh.dp_group, phase="metrics", scope="metrics")
    return t.item() / mesh.dp_size


def train(cfg: TrainConfig, mesh: ParallelMesh, model: torch.nn.Module | None = None,
          trackers: Trackers | None = None) -> RunSummary:
    """Run `cfg.steps` steps on this rank; returns the run's summary (same on all ranks).
    Rank 0 logs each step to `trackers` (default: those of `cfg.log`)."""
    loader, val_loader = prepare(cfg, mesh)
    model = model or train_model(cfg, mesh)
    model.train()
    tied = tied_embedding_group(mesh, model.config.tie_embeddings)
    cp_group = context.context_group(mesh, cfg.cp)  # ring attention (tpkit.parallel.context)
    if cp_group:
        context.enable(model, cp_group)
    sharding = build_sharding(model, cfg, mesh)  # ZeRO-2 / FSDP (tpkit.parallel.sharded)
    opt = sharding.optimizer if sharding else build_optimizer(model, cfg, mesh)
    sharded = isinstance(opt, ZeroAdamW)  # ZeRO-1 reduce-scatters instead of all-reducing
    dp_sync = sharding or OverlappedGradSync([] if sharded else list(model.parameters()),
                                             mesh.dp_group, cfg.micro_batches)
    stage = sharding.stage_model(model) if sharding else model  # FSDP gathers the root unit
    # gradients travel on their own communicator (see tpkit.parallel.p2p)
    half = torch.bfloat16 if cfg.master_weights else torch.float32  # between stages
    link = StageLink(mesh.pp_group, device=mesh.device, dtype=half,
                     backward_group=ring_backward_group(mesh))
    out, lead = Path(cfg.out), mesh.rank == 0
    with _materialized(sharding):
        start = resume(cfg, mesh, model, opt, loader) if cfg.resume else 0
    mixed = MasterWeights(model, train_model(cfg, mesh, half).train()) \
        if cfg.master_weights else None  # forward/backward in bf16, the rest on fp32 masters
    if mixed and cp_group:
        context.enable(mixed.compute, cp_group)
    log = run_log.MetricsLog(out / "metrics.jsonl" if lead else None, resume_step=start,
                             trackers=(trackers or Trackers(cfg)) if lead else None)
    bar = run_log.Progress(cfg.steps, lead and cfg.progress)
    autocast = (torch.autocast(mesh.device.type, dtype=torch.bfloat16)
                if cfg.dtype == "bfloat16" and not mixed else None)
    rows, ckpt, tokens_per_step = [], None, cfg.global_batch * cfg.seq
    guard = NonFiniteGuard(cfg.on_nonfinite, cfg.nonfinite_skips)
    train_s = idle = busy = 0.0
    try:
        for step in range(start, cfg.steps):
            mesh.ledger.clear()
            t_step = time.perf_counter()
            row = _step(cfg, mesh, stage, link, (tied, dp_sync, mixed, sharding, cp_group), opt,
                        loader, autocast, step, guard)
            span = (t_step, time.perf_counter())
            if cfg.check_replicas and (step + 1) % cfg.check_replicas == 0:
                with mesh.ledger.paused():  # not part of the step's theory
                    check_replicas(model, mesh.tp_group, step + 1)
            train_s += row["step_s"]
            if step > start or cfg.steps == start + 1:
                idle, busy = idle + row["idle_s"], busy + row["step_s"] - row["idle_s"]
            last_records = list(mesh.ledger.records)
            row["tokens_per_s"] = tokens_per_step / row["step_s"]
            row["comm_line"] = run_log.comm_line(row["comm"])
            if val_loader is not None and _due(step, cfg.eval_every, cfg.steps):
                row["val_loss"] = evaluate(cfg, mesh, mixed.compute if mixed else stage, link,
                                           val_loader, autocast, cp_group)
                if sharding:
                    sharding.release()
            rows.append(row)  # logged before the checkpoint: a resume from it finds the row
            log.write({k: v for k, v in row.items() if k != "comm_line"})
            bar.update(row)
            if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.steps:
                with _materialized(sharding):
                    ckpt = save_checkpoint(cfg, mesh, model, opt, loader, step + 1)
    except CollectiveFailed as e:  # a dead or stuck peer: say how far the run got
        raise e.after_step(start + len(rows)) from e.__cause__
    finally:
        bar.close()
        log.close()
        _close_link(link, sys.exc_info()[1] is not None, start + len(rows))
    if cfg.checkpoint:
        with _materialized(sharding):
            ckpt = save_checkpoint(cfg, mesh, model, opt, loader, cfg.steps)
    mesh.ledger.records[:] = last_records
    if cfg.trace:
        run_log.report_file("the trace", _write_trace, cfg, mesh, last_records, span)
    return _summary(cfg, mesh, model, rows, train_s, idle, busy, ckpt, lead, sharding)


def _materialized(sharding):
    """The full parameters around a checkpoint save or load (FSDP frees them again)."""
    return sharding.full_params() if sharding else nullcontext()


def _write_trace(cfg: TrainConfig, mesh: ParallelMesh, records, span) -> None:
    """This rank's timeline of the last step (`tpkit.train.trace`; merged by the command)."""
    from tpkit.train import trace

    title = f"rank {mesh.rank} (pp {mesh.pp_rank}, tp {mesh.tp_rank}, dp {mesh.dp_rank})"
    trace.write_rank(cfg.trace, mesh.rank, title, trace.step_events(records, *span, mesh.rank))


def _close_link(link: StageLink, failing: bool, steps_done: int) -> None:
    """Wait for the last pipeline sends. When the run is already failing, a dead peer
    surfacing here again must not replace the error that says how far the run got."""
    try:
        link.close()
    except CollectiveFailed as e:
        if not failing:
            raise e.after_step(steps_done) from e.__cause__


def _due(step: int, every: int, steps: int) -> bool:
    return step + 1 == steps or (every > 0 and (step + 1) % every == 0)


def _step(cfg, mesh, model, link, syncs, opt, loader, autocast, step: int,
          guard: NonFiniteGuard) -> dict:
    """One optimizer step; returns its metrics row."""
    t0 = time.perf_counter()
    lr = lr_at(step, cfg)
    set_lr(opt, lr)
    tied, dp_sync, mixed, sharding, cp_group = syncs
    ids, labels = context.local_chunks(*loader.next_batch(), cp_group)  # [G/dp, s/cp] each
    micro = micro_batches(ids.to(mesh.device), labels.to(mesh.device), cfg.micro_batches)
    dp_sync.arm()
    stats = run_schedule(cfg.schedule, mixed.compute if mixed else model, link, micro, autocast)
    dp_sync.finish()  # most buckets were sent during the last backward
    model.finalize_grads()
    if sharding:  # ZeRO-2 / FSDP: the gradients are dp shards already
        sharding.sync_tied(tied)
        norm = sharding.grad_norm()
    else:
        sync_tied_grads(model, tied)
        sharded = isinstance(opt, ZeroAdamW)
        if sharded:
            opt.reduce_gradients()
        norm = global_grad_norm(model, mesh, dp_sharded=sharded)
    loss = replica_mean(stats.loss, mesh)  # before the update: a NaN step never applies
    skipped = guard.skip(step + 1, loss, norm, model, mesh.rank)  # same on every rank
    if not skipped:
        if sharding:
            sharding.clip(norm, cfg.clip)
        else:
            clip_grads(model, norm, cfg.clip)
        opt.step()
    opt.zero_grad(set_to_none=True)
    if sharding:
        sharding.after_step()  # ZeRO-2: all-gather the weights; FSDP: free them
    if mixed and not skipped:
        mixed.copy_to_compute()
    comm = run_log.comm_by_group(mesh.ledger.records)
    return dict(step=step + 1, loss=loss, lr=lr, grad_norm=norm, idle_s=stats.idle_s,
                skipped=skipped,
                schedule_s=stats.total_s, max_inflight=stats.max_inflight,
                step_s=time.perf_counter() - t0, comm=comm,
                tokens=(step + 1) * cfg.global_batch * cfg.seq)


def evaluate(cfg: TrainConfig, mesh: ParallelMesh, model, link: StageLink,
             loader: TokenLoader, autocast=None, cp_group=None) -> float:
    """Mean validation loss over the first `cfg.eval_batches` held-out batches."""
    model.eval()
    loader.position, losses = 0, []
    for _ in range(cfg.eval_batches):
        ids, labels = context.local_chunks(*loader.next_batch(), cp_group)
        stats = forward_only(model, link, micro_batches(ids.to(mesh.device),
                                                        labels.to(mesh.device),
                                                        cfg.micro_batches), autocast)
        losses.append(replica_mean(stats.loss, mesh))
    model.train()
    return sum(losses) / len(losses)


def save_checkpoint(cfg: TrainConfig, mesh: ParallelMesh, model, opt, loader: TokenLoader,
                    step: int) -> str:
    """Sharded checkpoint at out/checkpoints/step_N: weights, AdamW (or ZeRO-1) state,
    and in `extra` the loader position, the step and this rank's generator states."""
    from tpkit.checkpoint import store as checkpoint
    from tpkit.checkpoint.locate import step_dir

    path = step_dir(cfg.out, step)
    rng = dict(checkpoint.capture_rng(mesh.device), tp=model.rng.state,
               device=mesh.device.type)
    checkpoint.save(path, model, opt, step=step, mesh=mesh,
                    extra=dict(loader=loader.state_dict(), step=step, rng=rng,
                               config=cfg.to_dict()),
                    tokenizer=cfg.from_hf or tokenizer_folder(cfg.data))  # for generate, export
    if mesh.rank == 0:  # the new one is complete: only now may the oldest go
        checkpoint.prune(path.parent, cfg.keep_checkpoints)
    return str(path)


def resume(cfg: TrainConfig, mesh: ParallelMesh, model, opt, loader: TokenLoader) -> int:
    """Load weights, optimizer state, loader position and generators from `cfg.resume`
    (a checkpoint directory: the command chose it, `commands.train.resume_dir`);
    returns the next step (the learning rate follows from it: `lr_at(step)`).

    At another layout `load` returns rank 0's extra: its default generator goes to every
    rank (tp ranks must draw alike), the per-tp-rank dropout generator keeps its seed;
    on another kind of device (a GPU checkpoint on CPU) the generators keep theirs.
    """
    from tpkit.checkpoint import store as checkpoint

    path = cfg.resume
    extra = checkpoint.load(path, model, opt, mesh=mesh)
    if int(extra["step"]) >= cfg.steps:
        raise UserError(f"{path} is at step {extra['step']}: nothing left to do for "
                         f"steps={cfg.steps}")
    loader.load_state_dict(extra["loader"])
    if extra.get("rng", {}).get("device") == mesh.device.type:
        checkpoint.restore_rng(extra["rng"], mesh.device)
        if extra["layout"] == mesh.layout:  # this rank's own extra: its own generator
            model.rng.state = extra["rng"]["tp"]
    return int(extra["step"])


def _summary(cfg, mesh, model, rows, train_s, idle, busy, ckpt, lead, sharding=None
             ) -> RunSummary:
    """Per-rank result: losses, throughput, bubble, this rank's comm table vs theory."""
    ratio = torch.tensor([idle / busy if busy > 0 else 0.0], dtype=torch.float64,
                         device=mesh.device)
    with mesh.ledger.paused():
        all_reduce(ratio, mesh.pp_group, phase="metrics", scope="metrics")
    c, b = model.config, cfg.micro_batch_size
    expects = theory.stage_step(c.hidden, b, cfg.seq // cfg.cp, mesh.tp_size, mesh.pp_size, cfg.sp,
                                cfg.micro_batches, model.is_first_stage, model.is_last_stage,
                                len(model.layer_range), model.virtual_stages,
                                recompute="full" if cfg.recompute else "none",
                                loss_chunk=model.loss_chunk)
    rows_t = theory_rows(mesh.ledger, expects)
    where = f"rank {mesh.rank} (stage {mesh.pp_rank}, tp rank {mesh.tp_rank})"
    tables = theory_table(rows_t, f"{where}: tp/pp traffic of one step vs theory")
    if sharding:  # the dp traffic of ZeRO-2 / FSDP against tpkit.spec.theory
        rows_dp = sharded_rows(mesh.ledger, sharding.expected(), sharding.scope)
        tables += "\n" + theory_table(rows_dp, f"{where}: {sharding.scope} dp traffic of one "
                                                f"step vs theory")
        rows_t = rows_t + rows_dp
    if cfg.cp > 1:  # the ring attention's hops on the cp group
        rows_cp = sharded_rows(mesh.ledger, context.expected(
            model, b, cfg.seq // cfg.cp, cfg.cp, cfg.micro_batches,
            "full" if cfg.recompute else "none"), "context_parallel", "cp")
        tables += "\n" + theory_table(rows_cp, f"{where}: ring attention (cp) vs theory")
        rows_t = rows_t + rows_cp
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    plot = None
    if lead and cfg.plot:
        plot = run_log.report_file("loss.png", run_log.plot_losses, rows,
                                   Path(cfg.out) / "loss.png",
                                   f"{cfg.model_name} tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}")
        plot = str(plot) if plot else None
    tail = min(10, len(rows))
    return RunSummary(
        config=cfg, rank=mesh.rank, stage=mesh.pp_rank, tp_rank=mesh.tp_rank, hidden=c.hidden,
        micro_batch=b, losses=[r["loss"] for r in rows], grad_norms=[r["grad_norm"] for r in rows],
        first_step=rows[0]["step"], tail=tail,
        tail_loss=sum(r["loss"] for r in rows[-tail:]) / tail, val_loss=val[-1] if val else None,
        tokens_per_s=len(rows) * cfg.global_batch * cfg.seq / train_s, seconds=train_s,
        bubble=ratio.item() / mesh.pp_size,
        bubble_theory=theory.bubble_theory(mesh.pp_size, cfg.micro_batches, model.virtual_stages),
        max_inflight=max(r["max_inflight"] for r in rows),
        table=mesh.ledger.table(f"{where}: everything sent in one step", by_scope=False),
        theory=tables,
        theory_ok=all(r["recorded"] == r["theory"] for r in rows_t), checkpoint=ckpt,
        metrics=str(Path(cfg.out) / "metrics.jsonl"), plot=plot, first_step_s=rows[0]["step_s"],
        later_step_s=statistics.median(r["step_s"] for r in rows[1:]) if len(rows) > 1 else 0.0)
