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
"""

from __future__ import annotations

import time

import torch

from tpkit.comm import isend, recv
from tpkit.comm.group import CommGroup


class StageLink:
    """Point-to-point traffic of one stage; counts the seconds spent waiting."""

    def __init__(self, group: CommGroup, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.group, self.dtype, self.device = group, dtype, torch.device(device)
        self.stage, self.stages = group.rank, group.size
        self.is_first, self.is_last = self.stage == 0, self.stage == self.stages - 1
        self._pending: list[tuple] = []  # (handle, tensor kept alive until the send is done)
        self.idle_s = 0.0

    # -- activations, forward -----------------------------------------------------------
    def recv_forward(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The previous stage's output [b, s, h] (a leaf that will collect its grad)."""
        x = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._recv(x, self.stage - 1, "forward")
        return x.requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        """This stage's output to the next stage (asynchronous)."""
        self._send(y.detach().to(self.dtype).contiguous(), self.stage + 1, "forward")

    # -- gradients, backward ------------------------------------------------------------
    def recv_backward(self, shape: tuple[int, ...]) -> torch.Tensor:
        """d loss / d (this stage's output), from the next stage."""
        g = torch.empty(shape, dtype=self.dtype, device=self.device)
        return self._recv(g, self.stage + 1, "backward")

    def send_backward(self, grad: torch.Tensor) -> None:
        """d loss / d (this stage's input) to the previous stage (asynchronous)."""
        self._send(grad.detach().to(self.dtype).contiguous(), self.stage - 1, "backward")

    # -- plumbing -----------------------------------------------------------------------
    def _recv(self, buf: torch.Tensor, src: int, phase: str) -> torch.Tensor:
        t0 = time.perf_counter()
        recv(buf, self.group, src, phase=phase, scope="pipeline")
        self.idle_s += time.perf_counter() - t0
        return buf

    def _send(self, x: torch.Tensor, dst: int, phase: str) -> None:
        self._pending.append((isend(x, self.group, dst, phase=phase, scope="pipeline"), x))

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
