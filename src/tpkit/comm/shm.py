"""The shared-memory transport: collectives between the ranks of one host, in microseconds.

    channel = ShmChannel.open(ranks, rank, pg, timeout_s, incarnation)   # every rank
    channel.all_reduce(x, "sum")                                         # in place

`collectives.py` calls it instead of torch.distributed when a group has a channel and
the tensor is one it takes (CPU; float32/bfloat16/float16 for a reduction, any dtype
for a broadcast or an all-gather); anything else goes to the group's process group. The kernels (`shm.cpp`) exchange data through one segment per
group, synchronised by per-rank sequence numbers in the segment, and sum in rank order
with float accumulation: every rank gets the same bits, run after run.

A peer that died (its pid gone or a zombie) is noticed within about 0.1 s; one that is
silent fails the wait after the group's timeout (inside `patient()`: never). Both raise
`ShmPeerLost`, which `collectives._guarded` turns into the usual one-line
`CollectiveFailed` naming it.
"""

from __future__ import annotations

import ctypes
import math
import os
import weakref
from collections import deque
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tpkit.comm.shm_build import load
from tpkit.comm.shm_names import segment_name

CHUNK_BYTES = 1 << 20  # bytes per rank and round (larger tensors go in several rounds)
SPLIT_BYTES = 64 << 10  # an all-reduce above this is a reduce-scatter + all-gather
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
REDUCE_OPS = {"sum": 0, "max": 1, "min": 2}


_csize = ctypes.c_size_t


def _ptr(x: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(x.data_ptr())


class ShmPeerLost(RuntimeError):
    """A shared-memory collective whose peer `peer` (index in the group) died or is silent."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class ShmChannel:
    """One group's shared-memory segment, mapped by this rank."""

    def __init__(self, lib, base: int, size: int, rank: int, nranks: int,
                 timeout_s: float, name: str) -> None:
        self._lib, self._base, self._size = lib, base, size
        self.rank, self.nranks, self.timeout_s, self.name = rank, nranks, timeout_s, name
        # the arguments that never change, as ctypes objects once (see shm_build)
        self._b, self._t = ctypes.c_void_p(base), ctypes.c_double(timeout_s)
        self._split = ctypes.c_size_t(SPLIT_BYTES)
        self._posted: dict[int, deque] = {}  # src -> receives posted, not yet taken
        self._who = ctypes.c_int(-1)
        self._who_ref = ctypes.byref(self._who)
        self._unmap = weakref.finalize(self, lib.tpk_unmap, base, size)

    @classmethod
    def open(cls, label: str, ranks: tuple[int, ...], rank: int, pg, timeout_s: float,
             incarnation: str) -> ShmChannel:
        """Collective over the group: its first rank creates the segment, every rank maps
        it, and once all have, the name is unlinked (the memory lives while mapped)."""
        lib = load()
        if lib is None:
            raise RuntimeError("the shared-memory kernels are not available")
        size = lib.tpk_size(len(ranks), CHUNK_BYTES)
        name = [segment_name(label, ranks, incarnation) if rank == 0 else None]
        base = None
        if rank == 0:
            base = lib.tpk_map(name[0].encode(), size, 1)
            if not base or lib.tpk_init(base, len(ranks), CHUNK_BYTES) != 0:
                name[0] = ""  # the others hear of it and fail too
        dist.broadcast_object_list(name, src=ranks[0], group=pg)
        if not name[0]:
            raise OSError(f"rank {ranks[0]} could not create a shared-memory segment of "
                          f"{size} bytes in /dev/shm")
        try:
            if rank != 0:
                base = lib.tpk_map(name[0].encode(), size, 0)
                if not base:
                    raise OSError(f"cannot map shared memory {name[0]}")
            if lib.tpk_join(base, rank, os.getpid()) != 0:
                raise OSError(f"shared memory {name[0]} is not a tpkit segment")
            dist.barrier(group=pg)  # every rank has mapped it
        finally:
            if rank == 0:
                lib.tpk_unlink(name[0].encode())
        return cls(lib, base, size, rank, len(ranks), timeout_s, name[0])

    @staticmethod
    def takes(x: torch.Tensor, copy: bool = False) -> bool:
        """True for the tensors this transport handles: CPU, a float dtype it sums (any
        dtype for a `copy`: a broadcast, an all-gather or a send moves bytes, such as the
        int64 step plan a serving rank 0 sends every token)."""
        return x.device.type == "cpu" and (copy or x.dtype in DTYPES)

    # -- collectives (every rank calls the same one, with the same sizes) --------------
    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `x` over the group in place (rank-order sum, float accumulation)."""
        buf = x if x.is_contiguous() else x.contiguous()
        self.check(self._lib.tpk_all_reduce(self._b, self.rank, _ptr(buf), _csize(buf.numel()),
                                            DTYPES[x.dtype], REDUCE_OPS[op], self._split,
                                            self._t, self._who_ref), "all_reduce")
        if buf is not x:
            x.copy_(buf)
        return x

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out (contiguous, nranks * x.numel()) = every rank's contiguous `x`, in rank order."""
        self.check(self._lib.tpk_all_gather(self._b, self.rank, _ptr(x), _ptr(out),
                                            _csize(x.numel() * x.element_size()), self._t,
                                            self._who_ref), "all_gather")
        return out

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum"
                       ) -> torch.Tensor:
        """out = this rank's chunk of the sum of every rank's contiguous `inp`."""
        self.check(self._lib.tpk_reduce_scatter(self._b, self.rank, _ptr(inp), _ptr(out),
                                                _csize(out.numel()), DTYPES[out.dtype],
                                                REDUCE_OPS[op], self._t, self._who_ref),
                   "reduce_scatter")
        return out

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Copy group rank `src`'s `x` into every rank's `x`, in place."""
        buf = x if x.is_contiguous() else x.contiguous()
        self.check(self._lib.tpk_broadcast(self._b, self.rank, _ptr(buf),
                                           _csize(buf.numel() * buf.element_size()), src,
                                           self._t, self._who_ref), "broadcast")
        if buf is not x:
            x.copy_(buf)
        return x

    def send(self, x: torch.Tensor, dst: int) -> bool:
        """Post contiguous `x` to group rank `dst` and return at once: True if it went
        into the mailbox, False if there was no room (send it over the process group:
        the receiver has been told to take it there)."""
        rc = self._lib.tpk_send(self._b, self.rank, _ptr(x), _csize(x.numel() * x.element_size()),
                                dst, self._t, self._who_ref)
        self.check(rc, "send")
        return rc == 0

    def recv(self, x: torch.Tensor, src: int) -> bool:
        """Receive group rank `src`'s next message into contiguous `x`: True if done, False
        if it comes over the process group (receive it there)."""
        rc = self._lib.tpk_recv(self._b, self.rank, _ptr(x), _csize(x.numel() * x.element_size()),
                                src, self._t, self._who_ref)
        self.check(rc, "recv")
        return rc == 0

    def posted(self, src: int) -> deque:
        """The receives from group rank `src` posted and not yet taken, oldest first."""
        return self._posted.setdefault(src, deque())

    def native_all_reduce(self) -> tuple[int, int, int, int, float, int]:
        """(tpk_all_reduce's address, segment, rank, split bytes, timeout, the address of the
        int where a failure names the peer): for native code that sums in place between
        its own kernels (`decode_ops`' layer stack at tp > 1); a code it returns goes to
        `check`."""
        fn = ctypes.cast(self._lib.tpk_all_reduce, ctypes.c_void_p).value
        return (fn, self._base, self.rank, SPLIT_BYTES, self.timeout_s,
                ctypes.addressof(self._who))

    def native_all_gather(self) -> int:
        """tpk_all_gather's address, for native code that gathers between its own kernels
        (the same arguments as `native_all_reduce`'s)."""
        return ctypes.cast(self._lib.tpk_all_gather, ctypes.c_void_p).value

    def check(self, rc: int, op: str) -> None:
        """Nothing for a collective's code 0 (or 4); else raise what it means."""
        if rc in (0, 4):  # 4: a message that goes over the process group
            return
        who = self._who.value
        if rc == 1:
            raise ShmPeerLost(f"shm {op}: connection closed: peer {who} died", who)
        if rc == 2:
            raise ShmPeerLost(f"shm {op}: timed out after {self.timeout_s:.1f} s waiting for "
                              f"peer {who}", who)
        raise RuntimeError(f"shm {op}: the ranks of the group called different collectives or "
                           f"sizes (rank {who} differs from rank {self.rank}): a bug of the "
                           f"caller")

    @contextmanager
    def patient(self):
        """Inside, a wait has no timeout while its peer lives (a dead one still ends it
        within ~0.1 s): a serving follower waiting for its leader's next step, which
        may be long in coming (rank 0 idle or busy planning; it is not in a collective)."""
        self._t.value = math.inf
        try:
            yield
        finally:
            self._t.value = self.timeout_s

    def close(self) -> None:
        """Unmap the segment (also done when the channel is collected)."""
        self._unmap()

    def __repr__(self) -> str:
        return f"ShmChannel({self.name}, rank={self.rank}/{self.nranks})"
