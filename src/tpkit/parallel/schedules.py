"""Pipeline schedules over a `StageLink`: GPipe, 1F1B (PipeDream-flush), forward-only.

Each stage runs the same program on its own layers; `F i` / `B i` is the forward /
backward of micro-batch i. With p stages and m micro-batches (p=4, m=4):

    GPipe  (all forwards, then all backwards; holds m activations)
      s0  F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
      s3  .  .  .  F0 F1 F2 F3 B3 B2 B1 B0
    1F1B  (p-s-1 warm-up forwards, then one forward one backward; holds <= p-s)
      s0  F0 F1 F2 .  .  F3 B0 .  B1 .  B2 .  B3
      s3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3

Both leave the same bubble, (p-1) forward+backward slots per stage, so idle/busy
= (p-1)/m (Narayanan et al. 2021, section 2.2); 1F1B only bounds the memory.
The loss of each micro-batch is divided by m so the accumulated gradients are the
gradients of the mean loss over the whole batch.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from tpkit.parallel.p2p import StageLink

SCHEDULES = ("gpipe", "1f1b")


@dataclass
class MicroBatch:
    """One micro-batch: token ids for the first stage, labels for the last."""

    ids: torch.Tensor  # [b, s] long
    labels: torch.Tensor  # [b, s] long


@dataclass
class StepStats:
    """What a schedule measured on this stage."""

    losses: list[float] = field(default_factory=list)  # per micro-batch (last stage only)
    idle_s: float = 0.0  # blocked in pipeline receives / sends
    total_s: float = 0.0  # wall time of the schedule
    max_inflight: int = 0  # most micro-batches whose activations were held at once

    @property
    def loss(self) -> float | None:
        """Mean loss over the micro-batches (None off the last stage)."""
        return sum(self.losses) / len(self.losses) if self.losses else None


def bubble_theory(stages: int, micro_batches: int) -> float:
    """Idle over busy time of a flushed pipeline: (p-1)/m."""
    return (stages - 1) / micro_batches


def _forward(model, link: StageLink, mb: MicroBatch, scale: float, stats: StepStats,
             autocast: AbstractContextManager | None):
    """One micro-batch forward; returns (input, output-or-scaled-loss)."""
    b, s = mb.labels.shape
    x = mb.ids if model.is_first_stage else link.recv_forward(model.activation_shape(b, s))
    with autocast or nullcontext():
        out = model(x)  # [b, s, h] hidden, or [b, s, V/tp] logits on the last stage
    if model.is_last_stage:
        loss = model.loss(out.float(), mb.labels)  # scalar, same on every tp rank
        stats.losses.append(loss.item())
        return x, loss * scale
    link.send_forward(out)
    return x, out


def _backward(model, link: StageLink, x: torch.Tensor, out: torch.Tensor) -> None:
    """Backward of one micro-batch; sends d loss / d input upstream."""
    if model.is_last_stage:
        out.backward()
    else:
        torch.autograd.backward(out, link.recv_backward(tuple(out.shape)).to(out.dtype))
    if not model.is_first_stage:
        link.send_backward(x.grad)


def gpipe(model, link: StageLink, micro: list[MicroBatch],
          autocast: AbstractContextManager | None = None) -> StepStats:
    """All forwards, then all backwards in reverse order (Huang et al. 2019)."""
    stats, t0, idle0 = StepStats(), time.perf_counter(), link.idle_s
    saved = [_forward(model, link, mb, 1.0 / len(micro), stats, autocast) for mb in micro]
    stats.max_inflight = len(saved)
    for x, out in reversed(saved):
        _backward(model, link, x, out)
    return _finish(link, stats, t0, idle0)


def one_f_one_b(model, link: StageLink, micro: list[MicroBatch],
                autocast: AbstractContextManager | None = None) -> StepStats:
    """1F1B: p-s-1 warm-up forwards, steady one-forward-one-backward, cool-down."""
    stats, t0, idle0 = StepStats(), time.perf_counter(), link.idle_s
    m, scale = len(micro), 1.0 / len(micro)
    warmup = min(link.stages - link.stage - 1, m)
    inflight: deque = deque()
    for i in range(warmup):
        inflight.append(_forward(model, link, micro[i], scale, stats, autocast))
        stats.max_inflight = len(inflight)
    for i in range(warmup, m):
        inflight.append(_forward(model, link, micro[i], scale, stats, autocast))
        stats.max_inflight = max(stats.max_inflight, len(inflight))
        _backward(model, link, *inflight.popleft())
    while inflight:
        _backward(model, link, *inflight.popleft())
    return _finish(link, stats, t0, idle0)


def forward_only(model, link: StageLink, micro: list[MicroBatch],
                 autocast: AbstractContextManager | None = None) -> StepStats:
    """Evaluation: forwards only, no graph kept (validation loss)."""
    stats, t0, idle0 = StepStats(), time.perf_counter(), link.idle_s
    with torch.no_grad():
        for mb in micro:
            _forward(model, link, mb, 1.0, stats, autocast)
    return _finish(link, stats, t0, idle0)


def _finish(link: StageLink, stats: StepStats, t0: float, idle0: float) -> StepStats:
    link.flush()
    stats.total_s = time.perf_counter() - t0
    stats.idle_s = link.idle_s - idle0
    return stats


def run_schedule(name: str, model, link: StageLink, micro: list[MicroBatch],
                 autocast: AbstractContextManager | None = None) -> StepStats:
    """Run the schedule called `name` ('gpipe' or '1f1b') for one step."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not one of {SCHEDULES}")
    return (gpipe if name == "gpipe" else one_f_one_b)(model, link, micro, autocast)
