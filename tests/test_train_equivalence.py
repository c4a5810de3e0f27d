"""3D parallelism changes nothing but the speed: 10 training steps at (tp, pp, dp)
give the losses and global gradient norms of the single-process run with the same
global batch and seed (relative difference <= 1e-4, float32).

What each layout exercises: tp — vocab-parallel embedding/loss and the tp grad
sums; pp — the schedule's p2p, the tied embedding summed between first and last
stage; dp — the batch sliced per replica and the averaged gradients; and all of
them — the clipping norm counting every parameter exactly once (clip=0.5 is active
at every step here, so a miscounted norm would change every loss after the first).
"""

from __future__ import annotations

import pytest
import torch

from tpkit.mesh import ParallelMesh
from tpkit.train.config import TrainConfig
from tpkit.train.loop import train

STEPS = 10


def _cfg(out: str, **kw) -> TrainConfig:
    base = dict(preset="gpt2-tiny", steps=STEPS, micro_batches=2, global_batch=8, seq=32,
                lr=3e-3, warmup=3, clip=0.5, val_fraction=0.0, out=out, progress=False,
                plot=False, checkpoint=False)
    return TrainConfig(**{**base, **kw})


def _train(mesh, cfg: TrainConfig) -> dict:
    r = train(cfg, mesh)
    return dict(losses=r.losses, norms=r.grad_norms, theory_ok=r.theory_ok)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the pool's workers: OpenMP threads thrash on a busy box
    try:
        return _train(ParallelMesh.single(), _cfg(out))
    finally:
        torch.set_num_threads(threads)


def _close(a: list[float], b: list[float], rel: float = 1e-4) -> float:
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
    assert worst <= rel, (worst, a, b)
    return worst


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tp,pp,dp,extra", [
    (2, 1, 1, {}), (1, 2, 1, {}), (1, 1, 2, {}), (2, 2, 1, {}), (2, 1, 2, {}),
    (1, 2, 2, dict(schedule="gpipe", zero1=True)),
    (2, 2, 1, dict(sp=True, schedule="gpipe")),
])
def test_layout_matches_single_process(run_tp, reference, tmp_path, tp, pp, dp, extra):
    cfg = _cfg(str(tmp_path), tp=tp, pp=pp, dp=dp, **extra)
    results = run_tp(_train, tp, cfg, pp=pp, dp=dp)
    assert all(r["losses"] == results[0]["losses"] for r in results)  # every rank agrees
    assert reference["norms"][0] > 0.5  # clipping is active from the first step
    _close(results[0]["losses"], reference["losses"])
    _close(results[0]["norms"], reference["norms"])
    assert all(r["theory_ok"] for r in results)  # tp and pp traffic as the theory says
    assert reference["losses"][-1] < reference["losses"][0]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sequence_parallel_on_a_length_tp_does_not_divide(run_tp, tmp_path):
    """tp=2 x pp=2 with SP on 31 tokens: 16 + 15 per tp rank, the pipeline passing each
    rank its own part; 2 steps give the single process's losses and norms, and every
    rank's traffic is the stage theory's (collectives padded to 2 x 16 tokens)."""
    short = dict(steps=2, seq=31, global_batch=4)
    ref = _train(ParallelMesh.single(), _cfg(str(tmp_path / "ref"), **short))
    results = run_tp(_train, 2, _cfg(str(tmp_path / "sp"), tp=2, pp=2, sp=True, **short), pp=2)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    _close(results[0]["losses"], ref["losses"])
    _close(results[0]["norms"], ref["norms"])
    assert all(r["theory_ok"] for r in results)
