"""The shared-memory transport (`comm/shm.py`) under the collectives.

- Every op (all-reduce sum/max/min, all-gather, reduce-scatter, broadcast) x dtype
  (float32, bfloat16, float16) x layout (contiguous or not) x size (one round, the
  reduce-scatter + all-gather split, several rounds of the segment) gives on two ranks
  the very bits of gloo, with the same ledger records.
- On four ranks the sum is the rank-order float sum, rounded once: the same bits on
  every rank, whichever rank reduced which slice, run after run.
- tp and dp groups of one mesh use it at once; two runs side by side never meet.
- A rank killed (SIGKILL) in the middle of a collective: the others fail at once (not at
  the timeout) with the one-line `CollectiveFailed` naming it.
- Nothing of a run stays in /dev/shm; without the kernels, one warning and gloo.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from tpkit.comm import all_gather, all_reduce, broadcast, reduce_scatter
from tpkit.comm.shm_names import SHM_DIR, remove_segments
from tpkit.launch import SpawnError, spawn

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# elements: one round below the split, one above it, several rounds of the 1 MiB segment
SIZES = (3, 40_000, 300_001)


def _data(rank: int, n: int, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 2, generator=g) * (1 + rank)
    x = x.t() if transposed else x.t().contiguous()  # [2, n], non-contiguous or not
    return x.to(dtype)


def _ops(x: torch.Tensor, group) -> dict[str, torch.Tensor]:
    even = x[:, : x.shape[1] // 2 * 2]
    return {
        "sum": all_reduce(x.clone(), group),
        "max": all_reduce(x.clone(), group, "max"),
        "min": all_reduce(x.clone(), group, "min"),
        "sum_view": all_reduce(x.clone().t(), group),  # a non-contiguous tensor, in place
        "gather0": all_gather(x, group, 0),
        "gather1": all_gather(x, group, 1),
        "scatter1": reduce_scatter(even, group, 1),
        "scatter0": reduce_scatter(x, group, 0),
        "bcast": broadcast(x.clone(), group, 1),
    }


def _shm_vs_gloo(mesh) -> list[str]:
    shm = mesh.tp_group
    assert shm.shm is not None, shm
    gloo = dataclasses.replace(shm, shm=None)  # the same process group, no channel
    bad = []
    for dtype in DTYPES:
        for n in SIZES:
            for transposed in (False, True)[: 1 if n == SIZES[-1] else 2]:
                x = _data(mesh.rank, n, dtype, transposed)
                mesh.ledger.clear()
                ours = _ops(x, shm)
                mine = [(r.op, r.numel, r.nbytes) for r in mesh.ledger.records]
                mesh.ledger.clear()
                ref = _ops(x, gloo)
                if mine != [(r.op, r.numel, r.nbytes) for r in mesh.ledger.records]:
                    bad.append(f"ledger differs {dtype} {n}")
                bad += [f"{k} {dtype} n={n} transposed={transposed}" for k in ours
                        if not torch.equal(ours[k], ref[k])]
    return bad + _copies_of_any_dtype(mesh, shm, gloo)


def _copies_of_any_dtype(mesh, shm, gloo) -> list[str]:
    """A broadcast or an all-gather of int64 / bool (a serving step's plan) goes through
    shared memory too (a reduction of them would not), with gloo's result."""
    ch, taken = shm.shm, []
    for name in ("broadcast", "all_gather"):
        real = getattr(ch, name)
        setattr(ch, name, lambda *a, _real=real, _n=name: taken.append(_n) or _real(*a))
    bad = []
    try:
        for dtype in (torch.int64, torch.bool):
            x = (torch.arange(11) * (mesh.rank + 3) % 5).to(dtype)
            ours = [broadcast(x.clone(), shm, 1), all_gather(x, shm, 0)]
            ref = [broadcast(x.clone(), gloo, 1), all_gather(x, gloo, 0)]
            bad += [f"{dtype} op {i}" for i in range(2) if not torch.equal(ours[i], ref[i])]
    finally:
        for name in ("broadcast", "all_gather"):
            delattr(ch, name)
    return bad + ([] if taken == ["broadcast", "all_gather"] * 2 else [f"shm took {taken}"])


def test_every_op_dtype_and_layout_gives_gloos_bits_on_two_ranks(pools):
    for rank, bad in enumerate(pools.run(_shm_vs_gloo, 2, mesh=dict(tp=2, comm="shm"))):
        assert bad == [], f"rank {rank}: {bad}"


def _rank_order(mesh) -> dict:
    group, out = mesh.tp_group, {}
    for dtype in DTYPES:
        for n in (8, 40_000, 300_000):  # one round, the split, three rounds
            xs = [_data(r, n, dtype, False) for r in range(group.size)]
            want = xs[0].float()
            for x in xs[1:]:
                want = want + x.float()
            got = [all_reduce(xs[group.rank].clone(), group) for _ in range(3)]
            rs = reduce_scatter(xs[group.rank], group, 1)
            mine = want.to(dtype).chunk(group.size, 1)[group.rank]
            out[(str(dtype), n)] = (all(torch.equal(g, want.to(dtype)) for g in got),
                                    torch.equal(rs, mine), got[0])
    return out


def test_four_ranks_sum_in_rank_order_with_float_accumulation(pools):
    ranks = pools.run(_rank_order, 4, mesh=dict(tp=4, comm="shm"))
    for key in ranks[0]:
        assert all(r[key][0] and r[key][1] for r in ranks), key
        assert all(torch.equal(r[key][2], ranks[0][key][2]) for r in ranks), key


def _tp_and_dp(mesh) -> tuple:
    tp, dp = mesh.tp_group, mesh.dp_group
    x = torch.full((1000,), float(mesh.rank))
    for _ in range(50):  # interleaved on both channels
        a = all_reduce(x.clone(), tp)
        b = all_reduce(x.clone(), dp)
    mine = sorted(p.name for p in SHM_DIR.glob(f"tpkit-*-{os.environ['TPKIT_RUN_ID']}-*"))
    return tp.shm is not None and dp.shm is not None, a[0].item(), b[0].item(), mine


def test_tp_and_dp_groups_share_memory_at_once_and_leave_no_name(pools):
    ranks = pools.run(_tp_and_dp, 4, mesh=dict(tp=2, dp=2, comm="shm"))
    # tp groups [0, 1], [2, 3]; dp groups [0, 2], [1, 3]
    assert [r[:3] for r in ranks] == [(True, 1.0, 2.0), (True, 1.0, 4.0), (True, 5.0, 2.0),
                                      (True, 5.0, 4.0)]
    assert all(r[3] == [] for r in ranks), ranks  # unlinked as soon as every rank mapped


def _many_sums(mesh, value: float) -> bool:
    x = torch.full((5000,), value * (mesh.rank + 1))
    return all(torch.equal(all_reduce(x.clone(), mesh.tp_group), 3 * x / (mesh.rank + 1))
               for _ in range(300))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_runs_side_by_side_never_meet():
    results: dict = {}

    def one(value: float) -> None:
        results[value] = spawn(_many_sums, 2, value, mesh=dict(tp=2, comm="shm"), threads=1,
                               timeout=240)

    threads = [threading.Thread(target=one, args=(v,)) for v in (1.0, 7.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {1.0: [True, True], 7.0: [True, True]}


def _killed_mid_collective(mesh) -> None:
    x = torch.ones(300_000)  # several rounds: rank 1 dies between two of them
    all_reduce(x, mesh.tp_group)
    if mesh.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    all_reduce(x, mesh.tp_group)


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_collective_is_named_in_one_line_at_once():
    with pytest.raises(SpawnError) as info:  # a 60 s timeout: only the pid check can be fast
        spawn(_killed_mid_collective, 2, mesh=dict(tp=2, comm="shm"), collective_timeout=60,
              timeout=100)
    line = str(info.value)
    assert "\n" not in line and line.startswith("rank 1 died (signal 9)"), line
    assert ("then rank 0: all_reduce over tp [0, 1] (scope top level, forward) failed after "
            in line and "a peer closed the connection: it died; suspects: rank 1)" in line), line


def test_the_launcher_sweeps_a_segment_left_during_set_up(tmp_path):
    from tpkit.comm.shm_names import segment_name

    os.environ["TPKIT_RUN_ID"], run = "sweep", None
    try:
        name = segment_name("tp", (0, 1), "0")
        run = name.split("-")[2]
        (SHM_DIR / name[1:]).write_bytes(b"left by a rank killed during set-up")
        assert remove_segments(run) == [name[1:]]
        assert not (SHM_DIR / name[1:]).exists()
    finally:
        del os.environ["TPKIT_RUN_ID"]


def leave_segment(rank: int) -> str:
    """What a rank killed during set-up would leave: a named segment of its run."""
    from tpkit.comm.shm_names import segment_name

    name = segment_name("tp", (0, 1), "0")[1:]
    (SHM_DIR / name).write_bytes(b"x")
    return name


_LAUNCHER = """
import time
from test_shm import leave_segment
from tpkit.launch import WorkerPool

pool = WorkerPool(2, threads=1)
print(",".join(pool.run(leave_segment)), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_launcher_killed_by_sigkill_leaves_nothing_in_dev_shm():
    """The workers notice their launcher's death (the lifeline pipe) and sweep the run's
    names before they end themselves."""
    import subprocess
    import sys
    import time

    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here.parent / "src"), str(here), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, TPKIT_RUN_ID="kill9")
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE,
                            text=True, env=env)
    names = [""]
    try:
        names = proc.stdout.readline().strip().split(",")
        assert len(names) == 2 and all("-kill9" in n for n in names), names
        assert all((SHM_DIR / n).exists() for n in names)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any((SHM_DIR / n).exists() for n in names) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any((SHM_DIR / n).exists() for n in names), names
    finally:
        proc.kill()
        remove_segments(names[0].split("-")[2] if names[0] else None)


def test_without_the_kernels_auto_warns_once_and_shm_refuses(monkeypatch, capsys):
    from tpkit.comm import shm_build, transport
    from tpkit.spec.errors import UserError

    monkeypatch.setenv("TPKIT_SHM_DISABLE", "1")
    shm_build.load.cache_clear()
    transport._warn_once.cache_clear()  # once per process: this test's process
    try:
        assert [transport.shm_ready("auto", 0) for _ in range(3)] == [False] * 3
        assert transport.shm_ready("auto", 1) is False  # other ranks: silent
        with pytest.raises(UserError, match="--comm shm: the shared-memory kernels"):
            transport.shm_ready("shm", 0)
    finally:
        shm_build.load.cache_clear()
        transport._warn_once.cache_clear()
    assert capsys.readouterr().err == ("tpkit: warning: shared-memory transport unavailable "
                                       "(TPKIT_SHM_DISABLE=1); all groups use gloo\n")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verify_passes_on_shared_memory_and_on_gloo_without_the_kernels(monkeypatch, capsys):
    """`tpkit verify --comm shm` at tp 1, 2, 4 (an error if shm could not be used), then
    a run without the kernels: exact on gloo, with one warning line from the launcher."""
    from tpkit.cli import main
    from tpkit.comm import shm_build, transport

    assert main(["verify", "--preset", "gpt2-tiny", "--layers", "1", "--seq", "8", "--tp",
                 "1,2,4", "--comm", "shm"]) == 0
    assert "OK: every tp matches tp=1" in capsys.readouterr().out
    monkeypatch.setenv("TPKIT_SHM_DISABLE", "1")
    shm_build.load.cache_clear()
    transport._warn_once.cache_clear()
    try:
        assert main(["verify", "--component", "mlp", "--tp", "1,2", "--hidden", "32", "--seq",
                     "8"]) == 0
    finally:
        shm_build.load.cache_clear()
        transport._warn_once.cache_clear()
    out = capsys.readouterr()
    assert "OK: every tp matches tp=1" in out.out
    assert out.err.count("shared-memory transport unavailable") == 1, out.err


def test_gloo_is_chosen_by_flag_or_env(monkeypatch):
    from tpkit.spec.errors import UserError
    from tpkit.spec.transport import comm_choice

    monkeypatch.setenv("TPKIT_COMM", "gloo")
    assert comm_choice(None) == "gloo" and comm_choice("shm") == "shm"
    monkeypatch.setenv("TPKIT_COMM", "tcp")
    with pytest.raises(UserError, match="comm='tcp' is not one of auto, shm, gloo"):
        comm_choice(None)


def _transports(mesh) -> tuple:
    return mesh.tp_group.shm is None, mesh.tp_group.size


def test_a_gloo_mesh_has_no_channel(pools):
    assert pools.run(_transports, 2, mesh=dict(tp=2, comm="gloo")) == [(True, 2)] * 2



def _ping_pong(mesh) -> list[bool]:
    """Both ranks post sends before receiving (as 1F1B does), sizes from one element to
    more than a mailbox holds (those go over gloo, in order); receives posted before the
    sends and waited for in any order (as ring attention does); a float64 (gloo)."""
    from tpkit.comm import isend, recv
    from tpkit.comm.collectives import irecv

    group, me = mesh.tp_group, mesh.tp_group.rank
    peer, ok = 1 - me, []
    for n in (1, 1000, 300_000, 2_000_000, 7):
        mine = [torch.full((n,), float(10 * me + k)) for k in range(3)]
        works = [isend(t, group, peer) for t in mine]
        for k in range(3):
            got = recv(torch.empty(2, n).t()[:, 0], group, peer)  # a non-contiguous buffer
            ok.append(torch.equal(got, torch.full((n,), float(10 * peer + k))))
        for w in works:
            w.wait()
    for n in (3, 2_000_000):  # receives posted first, waited for last one first
        bufs = [torch.empty(n) for _ in range(3)]
        posted = [irecv(b, group, peer) for b in bufs]
        works = [isend(torch.full((n,), float(10 * me + k)), group, peer) for k in range(3)]
        for p in reversed(posted):
            p.wait()
        ok += [torch.equal(b, torch.full((n,), float(10 * peer + k))) for k, b in enumerate(bufs)]
        for w in works:
            w.wait()
    works = [isend(torch.full((5,), float(me), dtype=torch.float64), group, peer)]
    ok.append(recv(torch.empty(5, dtype=torch.float64), group, peer)[0].item() == peer)
    works[0].wait()
    return ok


def test_point_to_point_sends_cross_in_order_whatever_their_size(pools):
    for rank, ok in enumerate(pools.run(_ping_pong, 2, mesh=dict(tp=2, comm="shm"))):
        assert all(ok), (rank, ok)
