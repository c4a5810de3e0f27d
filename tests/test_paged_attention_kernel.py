"""The decode rows' native attention over the paged cache (`kernels.paged_attention`).

Checked, on a flat cache whose blocks are scattered: every layout of query heads to kv
heads (MHA, GQA, MQA, and 9 heads / 3 kv at tp=2, whose ranks read kv heads unevenly),
with and without a sliding window, against a float64 reference and against SDPA on the
gathered keys (today's path): float32 within 2e-6 of the largest output, bfloat16 within
one bfloat16 ulp of the float64 reference rounded; a row's bits are the same alone or
among other rows, at 1 or 2 threads, with its blocks scattered or adjacent; a model's
token-by-token logits are as close to the float64 model's as its float32 full forward's,
with the kernel and without it (the library unavailable: SDPA runs, as before), and the
kernel ran where it should.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from checkpoint_helpers import LLAMA, SMOL, fill, random_full
from tpkit.decode.paged_kv import LAST, NONE, PagedCache, Piece, forward
from tpkit.kernels import paged_attention as pa
from tpkit.layers.attention import kv_index
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer

BS = 16
kernel = pytest.mark.skipif(pa.load() is None, reason="no C++ compiler: the kernel is off")
# (query heads, kv heads, index) of a rank: plain groups, MHA, MQA, 9/3 at tp=2's ranks
LAYOUTS = [(9, 3, None), (4, 4, None), (8, 1, None),
           (5, 2, kv_index(9, 3, 2, 0)), (4, 2, kv_index(9, 3, 2, 1))]


def _cache(nkv, hd=64, blocks=80, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(blocks * BS, nkv, hd, generator=g).to(dtype) for _ in range(2))
    return k, v


def _tables(lengths, blocks=80, seed=0):
    """A block table per length, its blocks scattered over the pool (never block 0)."""
    perm = (torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1)
    out, used = [], 0
    for n in lengths:
        nb = -(-n // BS)
        out.append(perm[used:used + nb].tolist())
        used += nb
    return out


def _kernel(q, k, v, rows, nq, nkv, index, threads=None):
    """rows: (row, table, lo, end); out [T, nq, hd] (untouched rows stay NaN)."""
    out = torch.full_like(q, float("nan"))
    pa.attend(q, k, v, out, pa.decode_plan(rows, BS, "cpu", threads),
              pa.kv_map(nq, nkv, None if index is None else tuple(index)))
    return out


def _keys(k, table, lo, end):
    pos = torch.tensor([table[j // BS] * BS + j % BS for j in range(lo, end)])
    return k[pos]  # [L, nkv, hd]


def _heads(nq, nkv, index):
    return torch.tensor(index if index is not None else [h // (nq // nkv) for h in range(nq)])


def _reference(q_r, k, v, table, lo, end, heads, dtype=torch.float64):
    """One row's attention, [nq, hd], by SDPA in `dtype` on its gathered keys."""
    K = _keys(k, table, lo, end)[:, heads].to(dtype).transpose(0, 1)[None]  # [1, nq, L, hd]
    V = _keys(v, table, lo, end)[:, heads].to(dtype).transpose(0, 1)[None]
    return F.scaled_dot_product_attention(q_r.to(dtype)[None, :, None], K, V)[0, :, 0]


@kernel
@pytest.mark.parametrize("nq, nkv, index", LAYOUTS)
@pytest.mark.parametrize("window", [None, 20])
def test_float32_matches_float64_and_sdpa(nq, nkv, index, window):
    lengths = [1, 16, 17, 45, 130, 1100]  # 1100: three chunks of the kernel's work, merged
    k, v = _cache(nkv, blocks=200)
    q = torch.randn(len(lengths), nq, 64, generator=torch.Generator().manual_seed(3))
    rows = [(r, t, max(0, n - window) if window else 0, n)
            for r, (n, t) in enumerate(zip(lengths, _tables(lengths, blocks=200)))]
    out = _kernel(q, k, v, rows, nq, nkv, index)
    heads = _heads(nq, nkv, index)
    for r, table, lo, end in rows:
        want = _reference(q[r], k, v, table, lo, end, heads)
        sdpa = _reference(q[r], k, v, table, lo, end, heads, torch.float32)
        scale = want.abs().max().item()
        assert (out[r].double() - want).abs().max().item() <= 2e-6 * scale, (r, end - lo)
        assert (out[r] - sdpa).abs().max().item() <= 2e-6 * scale, (r, end - lo)


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 bits as integers in the order of the values (adjacent values: +-1)."""
    b = x.view(torch.int16).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


@kernel
@pytest.mark.parametrize("nq, nkv, index", LAYOUTS[:2] + LAYOUTS[3:4])
def test_bfloat16_within_one_ulp_of_float64(nq, nkv, index):
    lengths = [1, 33, 200, 64]
    k, v = _cache(nkv, dtype=torch.bfloat16, seed=1)
    q = torch.randn(len(lengths), nq, 64, generator=torch.Generator().manual_seed(4))
    q = q.to(torch.bfloat16)
    rows = [(r, t, 0, n) for r, (n, t) in enumerate(zip(lengths, _tables(lengths, seed=1)))]
    out = _kernel(q, k, v, rows, nq, nkv, index)
    assert out.dtype == torch.bfloat16
    heads = _heads(nq, nkv, index)
    for r, table, lo, end in rows:
        want = _reference(q[r], k, v, table, lo, end, heads).to(torch.bfloat16)
        assert (_ordered(out[r]) - _ordered(want)).abs().max().item() <= 1, (r, end)


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_alone_among_others_threaded_and_scattered(dtype):
    """Row "mine" (1100 keys: three chunks of work) alone, then at another row index among
    long rows (above the work threshold, so two threads share the call: torch's OpenMP
    team's or the kernel's own), then with its blocks adjacent."""
    nq, nkv, index = 5, 2, kv_index(9, 3, 2, 0)
    k, v = _cache(nkv, blocks=200, dtype=dtype, seed=2)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, nq, 64, generator=g).to(dtype)
    mine = _tables([1100], blocks=200, seed=7)[0]
    lengths = [700, 900, 500, 64, 1]
    others = _tables(lengths, blocks=200, seed=8)  # (sharing some of mine: only read)
    alone = _kernel(q[:1], k, v, [(0, mine, 0, 1100)], nq, nkv, index, threads=1)[0]
    rows = [(r, t, 0, n) for r, (t, n) in enumerate(zip(others, lengths))]
    q2 = torch.cat([q[1:], q[:1]])  # mine is row 5 now
    for threads in (1, 2, -2):  # -2: two std::threads instead of torch's OpenMP team
        among = _kernel(q2, k, v, rows + [(5, mine, 0, 1100)], nq, nkv, index, threads)
        assert torch.equal(among[5], alone), threads
    adjacent = list(range(120, 120 + len(mine)))  # the same keys moved to adjacent blocks
    k2, v2 = k.clone(), v.clone()
    for new, old in zip(adjacent, mine):
        for t, src in ((k2, k), (v2, v)):
            t[new * BS:(new + 1) * BS] = src[old * BS:(old + 1) * BS]
    moved = _kernel(q[:1], k2, v2, [(0, adjacent, 0, 1100)], nq, nkv, index, threads=2)[0]
    assert torch.equal(moved, alone)
    assert not torch.equal(alone, _kernel(q[1:2], k, v, [(0, mine, 0, 1100)], nq, nkv, index)[0])


def _decode_logits(model, ids, keep):
    """Logits of the last `len(ids[0]) - keep` positions of each row, one token at a time
    over the paged cache (the rows' blocks interleaved), [b, n, V]."""
    b, s = ids.shape
    span = -(-s // BS)
    cache = PagedCache(model, BS)
    cache.grow(1 + b * span)
    tables = [[1 + i + b * j for j in range(span)] for i in range(b)]
    rows = ids.tolist()
    forward(model, cache, [Piece(r[:keep], 0, t, NONE) for r, t in zip(rows, tables)])
    steps = [forward(model, cache, [Piece([r[t]], t, tab, LAST)
                                    for r, tab in zip(rows, tables)])[0] for t in range(keep, s)]
    return torch.stack(steps, 1)


@pytest.mark.parametrize("config", [SMOL, LLAMA.with_(sliding_window=12)],
                         ids=["smol-uneven", "llama-window"])
def test_model_decode_is_as_accurate_as_the_full_forward_with_and_without_the_kernel(
        monkeypatch, config):
    """With the kernel (counted: one call per layer per step) and with the library
    unavailable (SDPA per sequence, as before): the token-by-token logits are as close to
    the float64 model's full forward as the float32 full forward is (within 2x; these
    random weights amplify float32 rounding to ~1e-4 of the logits on every path)."""
    model = Transformer(config, ParallelMesh.single())
    fill(model, random_full(config, seed=5, scale=1.0), ParallelMesh.single())
    ids = torch.randint(0, 257, (3, 36), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = copy.deepcopy(model).double()(ids)[:, 30:, :257]
        full = model(ids)[:, 30:, :257]
    calls, expected = [], 6 * config.num_layers if pa.load() is not None else 0
    attend = pa.attend
    monkeypatch.setattr(pa, "attend", lambda *a: calls.append(1) or attend(*a))
    with torch.no_grad():
        fast = _decode_logits(model, ids, 30)
        assert len(calls) == expected
        monkeypatch.setattr(pa, "load", lambda: None)  # the library unavailable
        slow = _decode_logits(model, ids, 30)
    assert len(calls) == expected  # none without the library

    def err(x):
        return ((x.double() - want).norm() / want.norm()).item()
    assert err(fast) <= 2 * err(full) and err(slow) <= 2 * err(full), (err(fast), err(slow))


def test_threads_on_torchs_team_or_where_its_workers_sleep(monkeypatch):
    """torch's OpenMP team (found in this process): torch's intra-op count whatever the
    wait policy; without it, own threads only under OMP_WAIT_POLICY=passive."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    if pa.load() is not None:
        assert pa.torch_pool()  # this torch runs on libgomp
        assert pa.kernel_threads() == torch.get_num_threads()
    monkeypatch.setattr(pa, "torch_pool", lambda: False)
    assert pa.kernel_threads() == 1
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert pa.kernel_threads() == torch.get_num_threads()


def test_the_library_is_named_after_the_cpu_it_was_built_for(monkeypatch):
    """-march=native: a tree copied to another CPU builds its own library rather than
    load one that may use instructions that CPU lacks; the shm library is portable."""
    from tpkit.comm import native, shm_build

    here, shm = pa.LIBRARY.library_path(), shm_build.library_path()
    monkeypatch.setattr(native, "cpu_signature", lambda: b"another cpu")
    assert pa.LIBRARY.library_path() != here and shm_build.library_path() == shm
