"""The tensor-parallel group of a server: this process is rank 0 (HTTP, engine,
sampler), ranks 1..tp-1 are local gloo processes that load their slices of the same
checkpoint and follow rank 0's steps (`Runner.follow`).

    peers = Peers(tp, load_args)     # spawns ranks 1.., joins the group as rank 0
    model = load(peers.mesh)         # every rank loads its own slices
    ... serve ...
    peers.close()                    # after Runner.lead_stop(): they return and exit

The workers are `tpkit.launch`'s (the same start, the same watch on the launcher: they
kill themselves if this process dies, even by SIGKILL). `dead()` names a worker that
died, so that the server can answer 503 and stop with one line naming the rank.
"""

from __future__ import annotations

import os
import pickle
import queue
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from tpkit.comm.shm_names import remove_segments
from tpkit.launch import start_workers, with_transport
from tpkit.mesh import ParallelMesh
from tpkit.serve.runner import Runner
from tpkit.weights.sources import load_model


def follow_worker(mesh: ParallelMesh, source, slots: int, max_len: int, chunk: int | None,
                  dtype: torch.dtype | None = None, quantize: str | None = None) -> int:
    """A rank > 0: load this rank's slices of `source` (opened by the command) in `dtype`
    (`quantize`: then as int8), then run rank 0's steps until told to stop."""
    model = load_model(source, mesh, dtype=dtype, quantize=quantize)
    return Runner(model, slots, max_len or model.config.max_seq_len, chunk).follow()


class Peers:
    """Ranks 1..tp-1 running `follow_worker`; this process joins their group as rank 0."""

    def __init__(self, tp: int, source, slots: int, max_len: int, chunk: int | None = None,
                 *, comm: str | None = None, timeout_s: float = 300.0,
                 dtype: torch.dtype | None = None, quantize: str | None = None) -> None:
        self.tp = tp
        mesh_kw = with_transport(dict(tp=tp, comm=comm))  # shared memory between us, or gloo
        self.run_id = os.environ.get("TPKIT_RUN_ID", "") + uuid.uuid4().hex[:8]
        os.environ["TPKIT_RUN_ID"] = self.run_id  # rank 0 names the segments: this run's
        threads = max(1, (os.cpu_count() or 1) // tp)
        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        self.procs, tasks, self._results, self._lifeline = start_workers(
            range(1, tp), tp, store.port, threads, timeout_s, {"TPKIT_RUN_ID": self.run_id},
            name="tpkit-serve-rank")
        job = pickle.dumps((follow_worker, (source, slots, max_len, chunk, dtype, quantize),
                             mesh_kw))
        for q in tasks:
            q.put((1, job))
            q.put(None)  # then exit
        self._store = store
        dist.init_process_group("gloo", store=store, rank=0, world_size=tp,
                                timeout=timedelta(seconds=timeout_s))
        self.mesh = ParallelMesh(**{"timeout_s": timeout_s, **mesh_kw})

    def dead(self) -> str | None:
        """'rank 1 died (signal 9)' for a worker that is gone, or a rank's own error."""
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode not in (None, 0):
                how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                return f"rank {r} died ({how})"
        try:
            _, rank, status, payload = self._results.get_nowait()
        except queue.Empty:
            return None
        if status == "err":
            return f"rank {rank} raised {payload[0]}: {payload[1].splitlines()[0][:300]}"
        return None

    def close(self, timeout: float = 5.0) -> None:
        """Wait for the workers to end (after STOP), kill any left; leave the group."""
        for p in self.procs:
            p.join(timeout=timeout)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._lifeline.close()
        remove_segments(self.run_id)
        if dist.is_initialized():
            dist.destroy_process_group()
