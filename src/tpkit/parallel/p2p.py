"""`StageLink`: what one pipeline stage sends to and receives from its neighbours.

    stage s-1 ──activation──▶ stage s ──activation──▶ stage s+1
              ◀──grad of it──         ◀──grad of it──

Every transfer goes through `tpkit.comm.send/recv` on `mesh.pp_group`, so the
ledger sees it (group "pp", phase forward for activations, backward for their
gradients). A blocking send is a rendezvous: it returns only once the peer has
posted the matching receive, so two neighbours that both send first would deadlock
(the steady state of 1F1B does exactly that). Sends are therefore posted with
`isend` (the tensor kept alive until flushed, as NCCL and gloo both require) and
receives block in the main thread. The time spent blocked in receives (and in the
final flush of sends) is the stage's idle time: the measured pipeline bubble.

Gradients travel on `backward_group`, a second process group over the same ranks
(`ring_backward_group`), for two reasons:
- on NCCL, operations of one communicator run in order on one stream, and a large
  send waits for its receive: stage s sending an activation forward while stage s+1
  sends a gradient back, each before its receive, would block both streams. With one
  communicator per direction, each carries messages one way only and cannot cycle;
- interleaved 1F1B makes the pipeline a ring (the last stage's chunk c feeds the
  first stage's chunk c+1), so with pp=2 both directions of a pair would carry
  activations AND gradients of the same shape, and a receive could match the wrong
  kind. On each (group, src, dst) channel one kind flows, in the same (chunk,
  micro-batch) order on both ends, so receives match sends one for one.
With pp=1 the ring closes on the stage itself: transfers go through a local queue.
(The NCCL reasoning is argued, not yet run: no multi-GPU machine was available.)
"""

from __future__ import annotations

import time
from collections import deque

import torch

from tpkit.comm import isend, recv
from tpkit.comm.group import CommGroup
from tpkit.mesh import ParallelMesh


class StageLink:
    """Point-to-point traffic of one stage; counts the seconds spent waiting."""

    def __init__(self, group: CommGroup, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 backward_group: CommGroup | None = None) -> None:
        self.group, self.dtype, self.device = group, dtype, torch.device(device)
        self.backward_group = backward_group or group  # gradients' channel (see above)
        self.stage, self.stages = group.rank, group.size
        self.is_first, self.is_last = self.stage == 0, self.stage == self.stages - 1
        self.next, self.prev = (self.stage + 1) % self.stages, (self.stage - 1) % self.stages
        self._pending: list[tuple] = []  # (handle, tensor kept alive until the send is done)
        self._local: dict[str, deque] = {"forward": deque(), "backward": deque()}  # pp=1 ring
        self.idle_s = 0.0

    # -- activations, forward -----------------------------------------------------------
    def recv_forward(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The previous stage's output [b, s, h] (a leaf that will collect its grad)."""
        x = torch.empty(shape, dtype=self.dtype, device=self.device)
        return self._recv(x, self.prev, "forward").requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        """This stage's output to the next stage (asynchronous)."""
        self._send(y.detach().to(self.dtype).contiguous(), self.next, "forward")

    # -- gradients, backward ------------------------------------------------------------
    def recv_backward(self, shape: tuple[int, ...]) -> torch.Tensor:
        """d loss / d (this stage's output), from the next stage."""
        g = torch.empty(shape, dtype=self.dtype, device=self.device)
        return self._recv(g, self.next, "backward")

    def send_backward(self, grad: torch.Tensor) -> None:
        """d loss / d (this stage's input) to the previous stage (asynchronous)."""
        self._send(grad.detach().to(self.dtype).contiguous(), self.prev, "backward")

    # -- plumbing -----------------------------------------------------------------------
    def _channel(self, phase: str) -> CommGroup:
        return self.group if phase == "forward" else self.backward_group

    def _recv(self, buf: torch.Tensor, src: int, phase: str) -> torch.Tensor:
        if src == self.stage:  # pp=1 ring: what this stage queued itself
            return buf.copy_(self._local[phase].popleft())
        t0 = time.perf_counter()
        recv(buf, self._channel(phase), src, phase=phase, scope="pipeline")
        self.idle_s += time.perf_counter() - t0
        return buf

    def _send(self, x: torch.Tensor, dst: int, phase: str) -> None:
        if dst == self.stage:
            self._local[phase].append(x)
            return
        work = isend(x, self._channel(phase), dst, phase=phase, scope="pipeline")
        self._pending.append((work, x))

    def flush(self) -> None:
        """Wait for every posted send (raises what a send raised); counted as idle."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()
        self.idle_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the last sends."""
        self.flush()


def ring_backward_group(mesh: ParallelMesh) -> CommGroup:
    """A second group over this rank's pp ranks, for gradients in an interleaved ring.

    Collective: every rank creates every pp group's twin, in the same order (as
    torch.distributed.new_group requires); named "pp" in the ledger like the first.
    """
    pp = mesh.pp_group
    if pp.size == 1:
        return pp
    return mesh.extra_group("pp-backward", "pp", mesh.all_groups("pp"))
