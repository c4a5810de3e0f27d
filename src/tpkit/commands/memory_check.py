"""Will a local run fit in memory? Asked before any process is spawned.

The planner's model prices each rank (`tpkit.plan.memory.memory_per_stage`: weights,
gradients, AdamW state, the activations of the micro-batches in flight, the logits of
the last stage), at the run's own precision (fp32 on CPU: 4 + 4 + 8 bytes a parameter)
and layout; the local ranks share one machine, so the run needs their sum plus what
each process costs before its first tensor (Python + torch, `PROCESS_BYTES`). Above
what the machine or its cgroup offers (`tpkit.host.memory.available`), one line:

    this run needs about 13.1 GiB (2 processes; the fullest rank 6.3 GiB: weights 1.5,
    gradients 1.5, AdamW 3.1, activations 0.1), 5.8 GiB is available (cgroup ...);
    fits with: --recompute --micro-batches 4; --force runs anyway

The flags tried are those that shrink the machine's total: --recompute, smaller
micro-batches, and with dp > 1 --zero1 / --zero2 / --fsdp. More tp or pp spreads a
model over more GPUs, not over one machine's memory, so it is not offered here; under
torchrun (one GPU per rank) the check is not made.
"""

from __future__ import annotations

from dataclasses import replace

from tpkit.host.memory import available, gib
from tpkit.plan.layout import Layout
from tpkit.plan.memory import Precision, memory_per_stage
from tpkit.spec.errors import UserError
from tpkit.train.config import TrainConfig

PROCESS_BYTES = 300 << 20  # Python with torch and tpkit imported (ru_maxrss: 295 MiB)


def precision_of(cfg: TrainConfig) -> Precision:
    """Bytes per parameter and activation of this run: fp32 (AdamW m, v: 8), bf16
    autocast (fp32 state, bf16 activations), or bf16 weights with fp32 masters."""
    if cfg.master_weights:
        return Precision.for_dtype("bf16")
    return Precision(4, 4, 8, 2 if cfg.dtype == "bfloat16" else 4)


def layout_of(cfg: TrainConfig) -> Layout:
    """The planner's Layout of a TrainConfig."""
    zero = 3 if cfg.fsdp else 2 if cfg.zero2 else 1 if cfg.zero1 else 0
    return Layout(cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch_size, sp=cfg.sp,
                  recompute="full" if cfg.recompute else "none", zero=zero,
                  interleave=cfg.virtual_stages, cp=getattr(cfg, "cp", 1),
                  fsdp_reshard=cfg.fsdp_reshard)


def estimate(cfg: TrainConfig) -> tuple[float, dict[str, float]]:
    """(bytes the whole local run needs, the fullest rank's parts)."""
    lay = layout_of(cfg)
    stages = memory_per_stage(cfg.model_config(), cfg.seq, lay, cfg.micro_batches,
                              precision_of(cfg), kernels="eager")  # tpkit's own block runs here
    ranks_per_stage = lay.devices // lay.pp
    total = sum(s["total"] for s in stages) * ranks_per_stage + PROCESS_BYTES * lay.devices
    return total, max(stages, key=lambda s: s["total"])


def check_fits(cfg: TrainConfig, force: bool) -> None:
    """A UserError line when the run will not fit in the memory available (not --force)."""
    room = available()
    if force or room is None:
        return
    need, worst = estimate(cfg)
    if need <= room[0]:
        return
    fits = _what_fits(cfg, room[0])
    parts = ", ".join(f"{k} {v / (1 << 30):.1f}" for k, v in worst.items() if k != "total")
    how = f"fits with: {fits}" if fits else "none of --recompute, smaller micro-batches, " \
        "--zero1/--zero2/--fsdp fits: use a machine with more memory or a smaller model"
    raise UserError(f"this run needs about {gib(need)} ({cfg.world_size} process"
                    f"{'es' if cfg.world_size > 1 else ''}; the "
                    f"fullest rank {gib(worst['total'])}: {parts}), {gib(room[0])} is "
                    f"available ({room[1]}); {how}; --force runs anyway")


def _what_fits(cfg: TrainConfig, room: float) -> str | None:
    """The first set of flags (one, then together) under which the run fits."""
    tries: list[tuple[str, dict]] = [("--recompute", dict(recompute=True))]
    m = cfg.micro_batches
    while cfg.global_batch % (cfg.dp * m * 2) == 0 and len(tries) < 4:
        m *= 2
        tries.append((f"--micro-batches {m}", dict(micro_batches=m)))
    if cfg.dp > 1:
        tries += [("--zero1", dict(zero1=True)), ("--zero2", dict(zero2=True)),
                  ("--fsdp", dict(fsdp=True))]
    for flags, change in tries:
        if estimate(replace(cfg, **change))[0] <= room:
            return flags
    best = dict(recompute=True, micro_batches=max([m] + [c.get("micro_batches", 1)
                                                       for _, c in tries]))
    if cfg.dp > 1:
        best["fsdp"] = True
    if estimate(replace(cfg, **best))[0] <= room:
        return " ".join(f for f, c in tries if set(c) <= set(best) and
                        all(best[k] == v for k, v in c.items()))
    return None
