"""The one place where tpkit communicates (torch.distributed or shared memory). Every
call is recorded in the ledger.

All functions take a `CommGroup`; on a group of one rank they return at once and
record nothing (nothing was sent). A group whose ranks share a host carries a
shared-memory channel (`comm/shm.py`, `group.shm`): every collective it can take
(CPU, float32/bfloat16/float16) goes there instead of to torch.distributed, under the
same ledger record and the same failure guard (point-to-point messages too: a send
that finds the peer's mailbox full goes over the process group, and says so to the
receiver). `phase` says whether the call belongs to the forward or the backward pass
(or to a label such as "grads"); `scope` overrides the ledger's current scope
(backward passes carry the scope of their forward).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from tpkit.comm.failure import CollectiveFailed, says_link_failed
from tpkit.comm.group import CommGroup
from tpkit.comm.shm import ShmChannel, ShmPeerLost

# torch 2.13 renamed the tensor forms (`*_into_tensor` -> `*_single`); accept both.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


_DISABLED: dict = {}  # collective -> its torch.compiler.disable form (`compile_ready`)


def _graph_break(fn):
    """Under torch.compile (`tpkit train --compile`) every collective is a clean graph
    break: it runs eagerly, between compiled regions, and is recorded in the ledger as
    always. Called eagerly, it skips `torch.compiler.disable`'s wrapper (a few us a call:
    the latency of a whole shared-memory all-reduce). The disabled forms are made by
    `compile_ready`, not here: `torch.compiler.disable` imports Dynamo, which would double
    the start of every `tpkit` command (about 1.5 s of CPU here)."""
    _DISABLED[fn] = None
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if is_compiling():
            return (_DISABLED[fn] or torch.compiler.disable(fn))(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def compile_ready() -> None:
    """Make every collective a graph break for torch.compile (imports Dynamo): called by
    the code that compiles (`Transformer(compile_backend=)`, the chunked loss), before
    it does."""
    for fn, disabled in _DISABLED.items():
        if disabled is None:
            _DISABLED[fn] = torch.compiler.disable(fn)


def _real(group: CommGroup) -> None:
    if group.pg is None:
        raise RuntimeError(f"{group!r} has no process group (a virtual mesh): it cannot "
                           f"communicate")


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _shm(group: CommGroup, x: torch.Tensor, copy: bool = False) -> ShmChannel | None:
    """The group's shared-memory channel if it takes `x`, else None (torch.distributed).
    `copy`: a collective that only moves bytes (broadcast, all-gather, a send or receive)
    takes any dtype (a sum only the dtypes it adds)."""
    ch = group.shm
    return ch if ch is not None and ch.takes(x, copy) else None


class _Done:
    """The handle of a collective that already completed (shared memory runs at once)."""

    def wait(self) -> bool:
        return True


def _link_failure(e: BaseException) -> bool:
    backend_error = getattr(dist, "DistBackendError", ())
    return isinstance(e, (backend_error, ShmPeerLost)) or says_link_failed(str(e))


class _guarded:
    """`with _guarded(op, group, numel, nbytes, phase, scope):` records the block in the
    ledger as one collective (if it completes); a dead or stuck peer becomes one
    `CollectiveFailed` naming the collective, its group, scope and the suspects. A class,
    not a generator: it runs around every collective, and costs a third as much."""

    __slots__ = ("op", "group", "numel", "nbytes", "phase", "scope", "peer", "t0")

    def __init__(self, op: str, group: CommGroup, numel: int, nbytes: int, phase: str,
                 scope: str | None, peer: int | None = None) -> None:
        self.op, self.group, self.numel, self.nbytes = op, group, numel, nbytes
        self.phase, self.scope, self.peer = phase, scope, peer

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, kind, e, tb) -> bool:
        t1 = time.perf_counter()
        group = self.group
        if kind is None:
            group.ledger.add(self.op, group, self.numel, self.nbytes, t1 - self.t0,
                             self.phase, self.scope, span=(self.t0, t1))
            return False
        if not isinstance(e, RuntimeError) or isinstance(e, CollectiveFailed) or \
                not _link_failure(e):
            return False
        where = group.ledger.current_scope() if self.scope is None else self.scope
        peer = getattr(e, "peer", None) if self.peer is None else self.peer  # shm names it
        raise CollectiveFailed(self.op, group.name, group.ranks, group.ranks[group.rank],
                               where, self.phase, t1 - self.t0, str(e).splitlines()[0],
                               None if peer is None else group.ranks[peer]) from e


@_graph_break
def all_reduce(x: torch.Tensor, group: CommGroup, op: str = "sum", *, phase: str = "forward",
               scope: str | None = None) -> torch.Tensor:
    """Reduce `x` over the group, in place; returns `x`."""
    if group.size == 1:
        return x
    _real(group)
    ch = _shm(group, x)
    with _guarded("all_reduce", group, x.numel(), _nbytes(x), phase, scope):
        if ch is not None:
            ch.all_reduce(x, op)
        else:
            dist.all_reduce(x, op=_REDUCE_OPS[op], group=group.pg)
    return x


def native_all_reduce(group: CommGroup) -> tuple | None:
    """For native code that sums over the group between its own kernels (`decode_ops`'
    layer stack at tp > 1): the shared-memory channel's all-reduce and its arguments
    (`ShmChannel.native_all_reduce`), None where the group has no channel. Its records go
    to `record_native`, a code it fails with to `native_failed`."""
    return None if group.size == 1 or group.shm is None else group.shm.native_all_reduce()


def native_all_gather(group: CommGroup) -> int | None:
    """The shared-memory channel's all-gather for native code (`native_all_reduce`'s
    arguments), None where the group has no channel."""
    return None if group.size == 1 or group.shm is None else group.shm.native_all_gather()


def record_native(group: CommGroup, op: str, x: torch.Tensor, spans, scopes,
                  phase: str = "forward") -> None:
    """Record collectives native code ran on tensors of x's size in the ledger: one per
    (start, end) in `spans` (time.perf_counter's clock), each in its scope."""
    ledger = group.ledger
    if ledger.enabled:
        numel, nbytes = x.numel(), _nbytes(x)
        for (t0, t1), scope in zip(spans, scopes):
            ledger.add(op, group, numel, nbytes, t1 - t0, phase, scope, span=(t0, t1))


def native_failed(group: CommGroup, op: str, code: int, x: torch.Tensor, scope: str,
                  phase: str = "forward", began: float | None = None) -> None:
    """Raise what a collective native code ran failed with (the shared-memory code
    `code`) means: Python's `CollectiveFailed`, timed from `began` (perf_counter's)."""
    with (guard := _guarded(op, group, x.numel(), _nbytes(x), phase, scope)):
        guard.t0 = guard.t0 if began is None else began
        group.shm.check(code, op)
    raise RuntimeError(f"{op} in native code returned {code}")


class Pending:
    """A collective in flight. `wait()` returns its result and records it in the ledger
    with the time it really cost this rank: posting it plus waiting for it (the time
    hidden behind other work is not counted)."""

    def __init__(self, work, finish, record: tuple, *, peer: int | None = None,
                 recorded: bool = True) -> None:
        self._work, self._finish, self._record = work, finish, record
        self._peer, self._recorded = peer, recorded
        self._posted_s = self._posted_at = 0.0

    def wait(self) -> torch.Tensor:
        """Block until done; the result."""
        op, group, numel, nbytes, phase, scope = self._record
        t0 = time.perf_counter()
        with group.ledger.paused(), _guarded(op, group, numel, nbytes, phase, scope,
                                             self._peer):
            self._work.wait()
        t1 = time.perf_counter()
        if self._recorded:
            group.ledger.add(op, group, numel, nbytes, self._posted_s + t1 - t0, phase, scope,
                             span=(self._posted_at, t1))
        return self._finish()


def _post(group: CommGroup, op: str, x: torch.Tensor, phase: str, scope: str | None,
          run) -> _Done | None:
    """An asynchronous collective on shared memory: `run(channel)` at once (guarded, not
    recorded: its `Pending` records it); None when the group's process group takes `x`."""
    ch = _shm(group, x)
    if ch is None:
        return None
    with group.ledger.paused(), _guarded(op, group, x.numel(), _nbytes(x), phase, scope):
        run(ch)
    return _Done()


@_graph_break
def all_reduce_async(x: torch.Tensor, group: CommGroup, *, phase: str = "backward",
                     scope: str | None = None) -> Pending:
    """Start summing `x` over the group in place; `.wait()` returns `x`."""
    _real(group)
    t0 = time.perf_counter()
    work = _post(group, "all_reduce", x, phase, scope, lambda ch: ch.all_reduce(x)) or \
        dist.all_reduce(x, group=group.pg, async_op=True)
    p = Pending(work, lambda: x, ("all_reduce", group, x.numel(), _nbytes(x), phase, scope))
    p._posted_s, p._posted_at = time.perf_counter() - t0, t0
    return p


@_graph_break
def reduce_scatter_async(x: torch.Tensor, group: CommGroup, dim: int, *,
                         phase: str = "backward", scope: str | None = None) -> Pending:
    """Start summing `x` and scattering `dim`; `.wait()` returns this rank's chunk."""
    _real(group)
    p_, dim = group.size, dim % x.dim()
    t0 = time.perf_counter()
    inp = x.movedim(dim, 0).contiguous()  # [S, ...]
    out = torch.empty(inp.shape[0] // p_, *inp.shape[1:], dtype=x.dtype, device=x.device)
    work = _post(group, "reduce_scatter", x, phase, scope,
                 lambda ch: ch.reduce_scatter(out, inp)) or \
        _reduce_scatter_single(out, inp, group=group.pg, async_op=True)
    p = Pending(work, lambda: (inp, out.movedim(0, dim))[1],  # inp kept alive until done
                ("reduce_scatter", group, x.numel(), _nbytes(x), phase, scope))
    p._posted_s, p._posted_at = time.perf_counter() - t0, t0
    return p


@_graph_break
def all_gather_async(x: torch.Tensor, group: CommGroup, *, out: torch.Tensor | None = None,
                     phase: str = "forward", scope: str | None = None) -> Pending:
    """Start concatenating every rank's 1-D `x` (rank order) into `out` (or a new tensor);
    `.wait()` returns it (FSDP prefetches the next layer's weights this way)."""
    _real(group)
    t0 = time.perf_counter()
    out = out if out is not None else x.new_empty(group.size * x.numel())  # [p n]
    x = x.contiguous()
    work = _post(group, "all_gather", out, phase, scope, lambda ch: ch.all_gather(out, x)) or \
        _all_gather_single(out, x, group=group.pg, async_op=True)
    p = Pending(work, lambda: out, ("all_gather", group, out.numel(), _nbytes(out), phase,
                                    scope))
    p._posted_s, p._posted_at = time.perf_counter() - t0, t0
    return p


@_graph_break
def all_gather(x: torch.Tensor, group: CommGroup, dim: int = -1, *, phase: str = "forward",
               scope: str | None = None) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    if group.size == 1:
        return x
    _real(group)
    p, dim = group.size, dim % x.dim()
    x = x.contiguous()
    out = torch.empty((p * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    ch = _shm(group, x, copy=True)
    with _guarded("all_gather", group, out.numel(), _nbytes(out), phase, scope):
        if ch is not None:
            ch.all_gather(out, x)
        else:
            _all_gather_single(out, x, group=group.pg)
    if dim == 0:
        return out
    out = out.view(p, *x.shape).movedim(0, dim)  # [..., p, x.shape[dim], ...]
    return out.reshape(*x.shape[:dim], p * x.shape[dim], *x.shape[dim + 1:])


@_graph_break
def reduce_scatter(x: torch.Tensor, group: CommGroup, dim: int = -1, *, phase: str = "forward",
                   scope: str | None = None) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's chunk of `dim`."""
    if group.size == 1:
        return x
    _real(group)
    p, dim = group.size, dim % x.dim()
    if x.shape[dim] % p:
        raise ValueError(f"reduce_scatter: dimension {dim} of size {x.shape[dim]} does not "
                         f"divide over {p} ranks")
    inp = x.movedim(dim, 0).contiguous()  # [S, ...]: chunk r of dim is rows r*S/p...
    out = torch.empty(inp.shape[0] // p, *inp.shape[1:], dtype=x.dtype, device=x.device)
    ch = _shm(group, x)
    with _guarded("reduce_scatter", group, x.numel(), _nbytes(x), phase, scope):
        if ch is not None:
            ch.reduce_scatter(out, inp)
        else:
            _reduce_scatter_single(out, inp, group=group.pg)
    return out.movedim(0, dim)


@_graph_break
def broadcast(x: torch.Tensor, group: CommGroup, src: int = 0, *, phase: str = "forward",
              scope: str | None = None) -> torch.Tensor:
    """Copy group rank `src`'s `x` to every rank, in place."""
    if group.size == 1:
        return x
    ch = _shm(group, x, copy=True)
    with _guarded("broadcast", group, x.numel(), _nbytes(x), phase, scope):
        if ch is not None:
            ch.broadcast(x, src)
        else:
            dist.broadcast(x, src=group.ranks[src], group=group.pg)
    return x


@_graph_break
def send(x: torch.Tensor, group: CommGroup, dst: int, *, phase: str = "forward",
         scope: str | None = None) -> None:
    """Point-to-point send to group rank `dst` (pipeline activations and gradients)."""
    x, ch = x.contiguous(), _shm(group, x, copy=True)
    with _guarded("send", group, x.numel(), _nbytes(x), phase, scope, dst):
        if ch is None or not ch.send(x, dst):
            dist.send(x, dst=group.ranks[dst], group=group.pg)


@_graph_break
def isend(x: torch.Tensor, group: CommGroup, dst: int, *, phase: str = "forward",
          scope: str | None = None):
    """Post a point-to-point send to group rank `dst` and return at once; `.wait()` the
    returned handle before reusing `x` (which must stay alive until then). Pipeline
    stages send this way so that two neighbours sending to each other cannot deadlock."""
    if not x.is_contiguous():
        raise ValueError("isend needs a contiguous tensor (it must outlive the send)")
    _real(group)
    ch = _shm(group, x, copy=True)
    with _guarded("send", group, x.numel(), _nbytes(x), phase, scope, dst):
        work = _Done() if ch is not None and ch.send(x, dst) else \
            dist.isend(x, dst=group.ranks[dst], group=group.pg)
    return Pending(work, lambda: x, ("send", group, x.numel(), _nbytes(x), phase, scope),
                   peer=dst, recorded=False)  # recorded once, when posted


@_graph_break
def recv(x: torch.Tensor, group: CommGroup, src: int, *, phase: str = "forward",
         scope: str | None = None) -> torch.Tensor:
    """Point-to-point receive into `x` from group rank `src`; returns `x`."""
    ch = _shm(group, x, copy=True)
    with _guarded("recv", group, x.numel(), _nbytes(x), phase, scope, src):
        if ch is None:
            dist.recv(x, src=group.ranks[src], group=group.pg)
        else:
            _ShmRecv(ch, x, group, src).wait()
    return x


class _ShmRecv:
    """A receive from shared memory: posted now, taken at `wait()`. Messages from one peer
    are taken in the order their receives were posted (a wait first takes the earlier
    ones); one that came over the process group (the mailbox was full) is received there."""

    def __init__(self, ch: ShmChannel, x: torch.Tensor, group: CommGroup, src: int) -> None:
        self.ch, self.x, self.group, self.src, self.done = ch, x, group, src, False
        ch.posted(src).append(self)

    def wait(self) -> bool:
        queue = self.ch.posted(self.src)
        while not self.done:
            queue.popleft()._take()
        return True

    def _take(self) -> None:
        x = self.x
        buf = x if x.is_contiguous() else x.contiguous()
        if not self.ch.recv(buf, self.src):
            dist.recv(buf, src=self.group.ranks[self.src], group=self.group.pg)
        if buf is not x:
            x.copy_(buf)
        self.done = True


@_graph_break
def irecv(x: torch.Tensor, group: CommGroup, src: int, *, phase: str = "forward",
          scope: str | None = None) -> Pending:
    """Post a point-to-point receive into `x` from group rank `src` and return at once;
    `.wait()` returns `x` (ring attention overlaps it with a block's computation)."""
    _real(group)
    t0 = time.perf_counter()
    ch = _shm(group, x, copy=True)  # shared memory: the message is taken at wait()
    work = _ShmRecv(ch, x, group, src) if ch is not None else \
        dist.irecv(x, src=group.ranks[src], group=group.pg)  # (it never blocks the sender)
    p = Pending(work, lambda: x, ("recv", group, x.numel(), _nbytes(x), phase, scope), peer=src)
    p._posted_s, p._posted_at = time.perf_counter() - t0, t0
    return p
