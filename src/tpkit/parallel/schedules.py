"""Pipeline schedules over a `StageLink`: GPipe, 1F1B, interleaved 1F1B, forward-only.

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

Interleaved 1F1B (section 2.2): each stage holds v chunks (virtual stage c*p + s),
each 1/v of its layers, and runs them in the order of Megatron-LM: forward k of the
stage is chunk (k // p) % v of micro-batch (k // (p v)) p + k % p (groups of p
micro-batches go through chunk 0, then chunk 1, ...), backward k the same with the
chunks reversed; (p-s-1)*2 + (v-1)*p warm-up forwards, then 1F1B, then cool-down.
p=2, v=2, m=4 (Fc.i: chunk c, micro-batch i):

      s0  F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 ...
      s1       F0.0 F0.1 F1.0 F1.1 B1.0 F0.2 B1.1 F0.3 ...

The fill and drain still take (p-1) slots, but of chunks 1/v as long: the bubble is
(p-1)/(v m), for v times more point-to-point messages. It needs m % p == 0.
The loss of each micro-batch is divided by m so the accumulated gradients are the
gradients of the mean loss over the whole batch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tpkit.parallel.p2p import StageLink
from tpkit.spec.errors import UserError
from tpkit.spec.shapes import interleave_problem
from tpkit.spec.theory import interleaved_order, interleaved_slot, warmup_forwards


class StageModel(Protocol):
    """What the schedules call on this stage's part of the model (`tpkit.model.Transformer`).

    A stage holds `virtual_stages` chunks (1 except for interleaved 1F1B); chunk c
    takes token ids [b, s] when it is the very first, else the previous chunk's
    activations of `activation_shape(b, s)`, and returns logits when it is the last.
    """

    virtual_stages: int

    def chunk_is_first(self, chunk: int) -> bool:
        """True for the first chunk of the whole pipeline (it reads token ids)."""

    def chunk_is_last(self, chunk: int) -> bool:
        """True for the last chunk of the whole pipeline (it returns logits)."""

    def activation_shape(self, b: int, s: int) -> tuple[int, ...]:
        """Shape of the activations that chunks pass on, for b sequences of s tokens."""

    def forward_chunk(self, chunk: int, x: torch.Tensor, *, seq: int) -> torch.Tensor:
        """ids [b, s] or activations -> activations, or logits [b, s, V/tp] when last;
        `seq` = s (with sequence parallelism the activations hold a part of it)."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, *,
             divide_by: float | None = None) -> torch.Tensor:
        """Mean cross-entropy (a scalar, the same on every tp rank); the sum over the
        labels not ignored divided by `divide_by` when given."""


@dataclass
class MicroBatch:
    """One micro-batch: token ids for the first stage, labels for the last."""

    ids: torch.Tensor  # [b, s] long
    labels: torch.Tensor  # [b, s] long (-100: no loss on it)
    divide_by: float | None = None  # the loss's divisor (None: its labels' count)


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


def _forward(model: StageModel, link: StageLink, mb: MicroBatch, scale: float, stats: StepStats,
             autocast: AbstractContextManager | None, chunk: int = 0):
    """One micro-batch forward of one chunk; returns (input, output-or-scaled-loss)."""
    b, s = mb.labels.shape
    x = mb.ids if model.chunk_is_first(chunk) else \
        link.recv_forward(model.activation_shape(b, s))
    with autocast or nullcontext():
        out = model.forward_chunk(chunk, x, seq=s)  # [b, s, h] hidden, or [b, s, V/tp] logits
    if model.chunk_is_last(chunk):
        loss = model.loss(out.float(), mb.labels, divide_by=mb.divide_by)  # same on all tp
        stats.losses.append(loss.item())
        return x, loss * scale
    link.send_forward(out)
    return x, out


def _backward(model: StageModel, link: StageLink, x: torch.Tensor, out: torch.Tensor,
              chunk: int = 0) -> None:
    """Backward of one micro-batch through one chunk; sends d loss / d input upstream."""
    if model.chunk_is_last(chunk):
        out.backward()
    else:
        torch.autograd.backward(out, link.recv_backward(tuple(out.shape)).to(out.dtype))
    if not model.chunk_is_first(chunk):
        link.send_backward(x.grad)


def gpipe(model: StageModel, link: StageLink, micro: list[MicroBatch],
          autocast: AbstractContextManager | None = None) -> StepStats:
    """All forwards, then all backwards in reverse order (Huang et al. 2019)."""
    stats, t0, idle0 = StepStats(), time.perf_counter(), link.idle_s
    saved = [_forward(model, link, mb, 1.0 / len(micro), stats, autocast) for mb in micro]
    stats.max_inflight = len(saved)
    for x, out in reversed(saved):
        _backward(model, link, x, out)
    return _finish(link, stats, t0, idle0)


def one_f_one_b(model: StageModel, link: StageLink, micro: list[MicroBatch],
                autocast: AbstractContextManager | None = None) -> StepStats:
    """1F1B: p-s-1 warm-up forwards, steady one-forward-one-backward, cool-down."""
    stats, t0, idle0 = StepStats(), time.perf_counter(), link.idle_s
    m, scale = len(micro), 1.0 / len(micro)
    warmup = warmup_forwards(link.stage, link.stages, 1, m)
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


def interleaved(model: StageModel, link: StageLink, micro: list[MicroBatch],
                autocast: AbstractContextManager | None = None) -> StepStats:
    """Interleaved 1F1B over the model's `virtual_stages` chunks (needs m % p == 0)."""
    stats, t0, idle0 = StepStats(), time.perf_counter(), link.idle_s
    m, v, scale = len(micro), model.virtual_stages, 1.0 / len(micro)
    if interleave_problem(m, link.stages):
        raise UserError(interleave_problem(m, link.stages))
    inflight: list[deque] = [deque() for _ in range(v)]  # per chunk, in micro-batch order
    for kind, c, i in interleaved_order(link.stage, link.stages, v, m):
        if kind == "F":
            inflight[c].append(_forward(model, link, micro[i], scale, stats, autocast, c))
            stats.max_inflight = max(stats.max_inflight, sum(map(len, inflight)))
        else:
            _backward(model, link, *inflight[c].popleft(), chunk=c)
    return _finish(link, stats, t0, idle0)


def forward_only(model: StageModel, link: StageLink, micro: list[MicroBatch],
                 autocast: AbstractContextManager | None = None) -> StepStats:
    """Evaluation: forwards only, no graph kept (validation loss); chunk by chunk in the
    interleaved order when the stage holds several."""
    stats, t0, idle0 = StepStats(), time.perf_counter(), link.idle_s
    v = model.virtual_stages
    with torch.no_grad():
        for c, i in (interleaved_slot(link.stages, v, k, False) for k in range(v * len(micro))):
            _forward(model, link, micro[i], 1.0, stats, autocast, c)
    return _finish(link, stats, t0, idle0)


def _finish(link: StageLink, stats: StepStats, t0: float, idle0: float) -> StepStats:
    link.flush()
    stats.total_s = time.perf_counter() - t0
    stats.idle_s = link.idle_s - idle0
    return stats


Schedule = Callable[[StageModel, StageLink, list[MicroBatch], AbstractContextManager | None],
                    StepStats]

SCHEDULES: dict[str, Schedule] = {"gpipe": gpipe, "1f1b": one_f_one_b,
                                  "interleaved": interleaved}  # the one list of schedules
CHUNKED = "interleaved"  # the schedule that runs a stage of several chunks


def schedule_problems(name: str, virtual_stages: int) -> list[str]:
    """Why schedule `name` cannot run a stage of `virtual_stages` chunks (empty: it can)."""
    if name not in SCHEDULES:
        return [f"schedule={name!r} is not one of {tuple(SCHEDULES)}"]
    if name != CHUNKED and virtual_stages > 1:
        return [f"virtual_stages={virtual_stages} needs schedule={CHUNKED!r}, not {name!r}"]
    return []


def run_schedule(name: str, model: StageModel, link: StageLink, micro: list[MicroBatch],
                 autocast: AbstractContextManager | None = None) -> StepStats:
    """Run the schedule called `name` (a key of `SCHEDULES`) for one step."""
    problems = schedule_problems(name, model.virtual_stages)
    if problems:
        raise ValueError(problems[0])
    return SCHEDULES[name](model, link, micro, autocast)
