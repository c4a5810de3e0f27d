"""Training resumed from a checkpoint, at another layout, continues the uninterrupted run.

Math checked: a run of N+M steps at layout A that writes a checkpoint after step N is
the uninterrupted run. Loading that checkpoint at layout B and running steps N+1..N+M
gives its last M losses (relative difference <= 1e-4, float32: only the reduction
order changes with the layout), because everything a step depends on comes back:
the weights, AdamW's moments and step count (bias correction), the loader position
(the same global batches, whatever dp slices them into), the learning rate
(`lr_at(step)`), and the generators (dropout).

ZeRO-1 keeps the moments as flat dp slices; the checkpoint holds them per parameter,
so a plain run resumes with ZeRO-1 at dp=2, and that run's checkpoint resumes plain.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tpkit.checkpoint import store as ckpt
from tpkit.mesh import ParallelMesh
from tpkit.model import Transformer
from tpkit.spec import get_preset
from tpkit.train.config import TrainConfig
from tpkit.train.loop import train

N, M, G = 3, 3, 8  # steps before the checkpoint, steps after it, global batch
MODEL = replace(get_preset("gpt2-tiny"), num_layers=2)


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(preset="gpt2-tiny", steps=N + M, micro_batches=2, global_batch=G, seq=16,
                lr=3e-3, warmup=2, clip=0.5, val_fraction=0.0, out=str(out), progress=False,
                plot=False, checkpoint=False)
    return TrainConfig(**{**base, **kw})


def _train(mesh, cfg: TrainConfig, dropout: float = 0.0) -> dict:
    """Train a 2-layer gpt2-tiny; the losses, and rank 0's metric rows (step, lr)."""
    model = Transformer(replace(MODEL, dropout=dropout), mesh, seed=cfg.seed)
    r = train(cfg, mesh, model)
    rows = [json.loads(line) for line in Path(r.metrics).read_text().splitlines()] \
        if mesh.rank == 0 else None
    return dict(losses=r.losses, rows=rows)


def _single(cfg: TrainConfig, dropout: float = 0.0) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the pool's workers
    try:
        return _train(ParallelMesh.single(), cfg, dropout)
    finally:
        torch.set_num_threads(threads)


def _run(run_tp, cfg: TrainConfig) -> dict:
    if cfg.world_size == 1:
        return _single(cfg)
    results = run_tp(_train, cfg.tp, cfg, pp=cfg.pp, dp=cfg.dp)
    assert all(r["losses"] == results[0]["losses"] for r in results)  # every rank agrees
    return results[0]


def _worst(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), (got, want)
    return max(abs(x - y) / abs(y) for x, y in zip(got, want))


def _step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:06d}"


@pytest.fixture(scope="module")
def uninterrupted(run_tp, tmp_path_factory) -> dict:
    """N+M steps at (tp=2, pp=2), a checkpoint after step N."""
    out = tmp_path_factory.mktemp("a22")
    ref = _run(run_tp, _cfg(out, tp=2, pp=2, ckpt_every=N))
    ref["ckpt"] = _step_dir(out, N)
    return ref


@pytest.mark.timeout(120)
def test_resume_at_other_layouts(run_tp, uninterrupted, tmp_path):
    ref, path = uninterrupted, uninterrupted["ckpt"]
    manifest = ckpt.read_manifest(path)
    assert manifest["step"] == N and manifest["layout"] == dict(tp=2, pp=2, dp=1)
    assert manifest["extra"]["loader"]["position"] == N * G
    assert ref["losses"][-1] < ref["losses"][0]
    worst = {}
    for tp, pp, dp in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)]:
        cfg = _cfg(tmp_path / f"b{tp}{pp}{dp}", tp=tp, pp=pp, dp=dp, resume=str(path),
                   checkpoint=True)
        got = _run(run_tp, cfg)
        worst[(tp, pp, dp)] = _worst(got["losses"], ref["losses"][N:])
        assert [r["step"] for r in got["rows"]] == list(range(N + 1, N + M + 1))
        assert [r["lr"] for r in got["rows"]] == [r["lr"] for r in ref["rows"][N:]]
        end = ckpt.read_manifest(_step_dir(Path(cfg.out), N + M))
        assert end["extra"]["loader"]["position"] == (N + M) * G
    assert max(worst.values()) <= 1e-4, worst


@pytest.mark.timeout(120)
def test_zero1_checkpoint_is_plain_adamw_state(run_tp, uninterrupted, tmp_path):
    """Plain (2, 2) -> ZeRO-1 at dp=2 (checkpoint after step N+1) -> plain (2, 1)."""
    ref = uninterrupted
    zero_out = tmp_path / "zero"
    zero = _run(run_tp, _cfg(zero_out, dp=2, zero1=True, resume=str(ref["ckpt"]),
                             ckpt_every=N + 1))
    assert _worst(zero["losses"], ref["losses"][N:]) <= 1e-4
    path = _step_dir(zero_out, N + 1)
    m = ckpt.read_manifest(path)
    assert m["layout"]["dp"] == 2 and m["optimizer"]["type"] == "ZeroAdamW"
    want = ckpt.read_manifest(ref["ckpt"])["optim_tensors"]
    assert m["optim_tensors"].keys() == want.keys()  # exp_avg, exp_avg_sq, step per param
    for name, meta in want.items():
        assert m["optim_tensors"][name]["shape"] == meta["shape"], name
    plain = _run(run_tp, _cfg(tmp_path / "plain", tp=2, resume=str(path)))
    assert _worst(plain["losses"], ref["losses"][N + 1:]) <= 1e-4


@pytest.mark.timeout(60)
def test_resume_restores_the_generators(tmp_path):
    """With dropout the next steps draw the masks the uninterrupted run drew: exact."""
    ref = _single(_cfg(tmp_path / "a", ckpt_every=N), dropout=0.1)
    got = _single(_cfg(tmp_path / "b", resume=str(_step_dir(tmp_path / "a", N))),
                  dropout=0.1)
    assert got["losses"] == ref["losses"][N:]
