"""The decode rows' attention over the paged KV cache, one native call per layer.

    plan = decode_plan([(row, blocks, lo, end), ...], block_size)   # once per forward
    if plan is not None and usable(q, cache_k):
        attend(q, cache_k, cache_v, out, plan, kv_map(nq, nkv, kv_index))   # q, out [T, nq, hd]

What it computes: for every decode row (a sequence's piece of one token) and every local
query head h, out[row, h] = softmax(q[row, h] . K^T / sqrt(hd)) V over the row's keys,
positions lo <= j < end (end = its position + 1; lo > 0 under a sliding window: keys in
(pos - window, pos]), read in place from the flat cache k, v [blocks * block_size,
kv_local, hd] through the row's block table (no gather copy); query head h reads local
kv head kv_map[h] (a plain group, or `ParallelAttention.kv_index`'s uneven mapping). The
scale is SDPA's, 1/sqrt(hd). float32 or bfloat16 (queries and cache of one dtype):
bfloat16 values are widened exactly, every sum is float32, the output is rounded once
to q's dtype. One call does every decode row of a layer; rows of longer pieces
(prefill) stay on SDPA (`decode.attend.attend_paged`).

Guarantees:
- Batch invariance by construction: a row's output depends only on its own q, keys and
  values. A work item is (row, chunk of 512 of its keys), every head, computed whole by
  one thread in an order fixed by the row's own keys, its chunks merged in order
  (`paged_attention.cpp`): the same bits whatever other rows share the call, however
  many threads run, wherever its blocks lie.
- Accuracy: a two-pass softmax (every score, their max, then exponentials); within
  ~1e-6 relative of a float64 reference in float32, within 1 bfloat16 ulp of the float64
  reference rounded in bfloat16 (tests/test_paged_attention_kernel.py). Not SDPA's bits:
  a different order of the same sums.
- Threads: the work items spread over torch's own OpenMP team (libgomp's
  `GOMP_parallel`, found in the process: the workers torch already runs, never a second
  OpenMP runtime), up to torch's intra-op count, above 1M multiply-adds a call (one row
  of ~900 keys, eight of ~115). The team's workers spin for milliseconds after every
  torch op (libgomp's default), so right after a layer's matmul they take the work at
  once; threads of the kernel's own would share a core with a spinning worker and gain
  nothing (measured on 2 cores, 8 rows x 4096 keys after a matmul: 5.5 ms at 2 such
  threads vs 5.3 at one; with nothing before: 2.7 vs 5.1). Without such a team (torch
  built on another backend) std::threads serve, above 4M multiply-adds, and only under
  OMP_WAIT_POLICY=passive (torch's workers then sleep when idle).

The library is compiled for this CPU (-O3 -march=native: built per machine at install,
its name hashing the CPU's flags) by `comm.native.NativeLibrary`, like the shared-memory
kernels. Without it (no compiler, a CUDA tensor, float16, TPKIT_ATTN_DISABLE=1)
`decode_plan` gives None or `usable` False, and the rows take SDPA as before.

    python -m tpkit.kernels.paged_attention   # build it (what `make` runs after installing)
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tpkit.comm.native import NativeLibrary

SOURCE = Path(__file__).with_name("paged_attention.cpp")
LIBRARY = NativeLibrary(
    "paged_attention", (SOURCE, SOURCE.with_name("native_common.h")),
    Path(__file__).with_name("_native_build"),
    ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing",
     "-pthread"),
    signatures={"tpk_paged_attention": (None, ctypes.c_int)},  # ctypes objects passed
    disable_env="TPKIT_ATTN_DISABLE", per_cpu=True)
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.lru_cache(maxsize=1)  # one load per process
def load() -> ctypes.CDLL | None:
    """The loaded kernel, or None (no compiler, or TPKIT_ATTN_DISABLE=1)."""
    return LIBRARY.open()


@dataclass
class DecodePlan:
    """One forward's decode rows for the kernel, built once and read by every layer:
    `meta` int64 [rows, 4] (the row in q and out, the offset of its block table in the
    tables that follow, lo, end) then every row's block table, flattened."""

    meta: torch.Tensor
    rows: int
    args: tuple  # (meta pointer, rows, threads) as ctypes objects


@functools.lru_cache(maxsize=1)
def torch_pool() -> bool:
    """Whether the kernel's threads are torch's own OpenMP team (module docstring)."""
    lib = load()
    return lib is not None and lib.tpk_paged_attention_pool() == 1


def kernel_threads() -> int:
    """How many threads a call may use: torch's intra-op count on torch's own OpenMP team,
    or with threads of its own where torch's workers sleep when idle
    (OMP_WAIT_POLICY=passive); else 1 (module docstring: Threads)."""
    passive = os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive"
    return torch.get_num_threads() if torch_pool() or passive else 1


def decode_plan(rows: list[tuple[int, list[int], int, int]], block_size: int, device,
                threads: int | None = None) -> DecodePlan | None:
    """The plan of decode rows (row, block table, lo, end), or None where the kernel
    cannot run (no row, not on the CPU, no library). `threads`: at most this many
    (default `kernel_threads()`; -n: n threads of the kernel's own, not torch's team)."""
    if not rows or torch.device(device).type != "cpu" or load() is None:
        return None
    head, tables = [], []
    for row, blocks, lo, end in rows:
        head += [row, len(tables), lo, end]
        tables += blocks
    meta = torch.tensor(head + tables, dtype=torch.long)
    args = (ctypes.c_void_p(meta.data_ptr()), ctypes.c_int(len(rows)),
            ctypes.c_int(block_size), ctypes.c_int(threads or kernel_threads()))
    return DecodePlan(meta, len(rows), args)


@functools.lru_cache(maxsize=64)
def kv_map(nq: int, nkv: int, index: tuple[int, ...] | None) -> tuple[torch.Tensor, object]:
    """int32 [nq]: the local kv head each local query head reads (`index`, or the plain
    group h // (nq / nkv)), and its pointer; one per layer shape, kept."""
    t = torch.tensor(index if index is not None else [h // (nq // nkv) for h in range(nq)],
                     dtype=torch.int32)
    return t, ctypes.c_void_p(t.data_ptr())


def usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel takes these: CPU tensors of one dtype it knows, a contiguous
    cache."""
    return (q.dtype == k.dtype and q.dtype in DTYPES and k.device.type == "cpu"
            and k.is_contiguous())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           plan: DecodePlan, kv: tuple[torch.Tensor, object]) -> None:
    """out[row] for every decode row of `plan` (module docstring). q [T, nq, hd] (its
    heads contiguous: q[t] may be the first heads of a longer row, as the q of a fused
    qkv), out [T, nq, hd] contiguous, k, v [positions, nkv, hd] contiguous, all of one
    dtype (`usable`)."""
    T, nq, hd = q.shape
    if q.stride(2) != 1 or q.stride(1) != hd:
        q = q.contiguous()
    meta, rows, bs, threads = plan.args
    rc = load().tpk_paged_attention(
        ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(k.data_ptr()),
        ctypes.c_void_p(v.data_ptr()), ctypes.c_void_p(out.data_ptr()), meta, kv[1], rows,
        ctypes.c_int(nq), ctypes.c_int(k.shape[1]), ctypes.c_int(hd), bs,
        ctypes.c_int(DTYPES[q.dtype]), threads, ctypes.c_int64(q.stride(0)))
    if rc != 0:
        raise RuntimeError(f"tpk_paged_attention returned {rc}")


def main() -> int:
    """Build the library; print where it is."""
    return LIBRARY.main("paged attention kernel", "decode attention runs on SDPA")


if __name__ == "__main__":
    sys.exit(main())
