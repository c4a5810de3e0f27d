"""Pipeline schedules: GPipe and 1F1B compute the same step, 1F1B holding at most
p - s micro-batches' activations on stage s instead of m; every stage sends m
activations forward and receives m gradients back (the ledger against theory);
the bubble is measured as idle/busy per stage next to (p-1)/m; the tied embedding
(first stage) and head (last stage) get the same summed gradient and stay equal."""

from __future__ import annotations

import math

import pytest
import torch

from tpkit.layers.sharding import meta_of
from tpkit.parallel.data_parallel import tied_params
from tpkit.spec.theory import bubble_theory, peak_in_flight
from tpkit.train.config import TrainConfig
from tpkit.train.loop import train, train_model


def _cfg(out: str, **kw) -> TrainConfig:
    base = dict(preset="gpt2-tiny", steps=3, micro_batches=4, global_batch=8, seq=32,
                val_fraction=0.0, out=out, progress=False, plot=False, checkpoint=False)
    return TrainConfig(**{**base, **kw})


def _both_schedules(mesh, out: str) -> dict:
    runs = {}
    for schedule, m in (("gpipe", 4), ("1f1b", 4), ("1f1b", 2)):  # m=2 < p: warm-up capped
        r = train(_cfg(out, pp=mesh.pp_size, schedule=schedule, micro_batches=m), mesh)
        runs[(schedule, m)] = {k: getattr(r, k) for k in ("losses", "grad_norms", "bubble",
                                                 "bubble_theory", "theory_ok", "max_inflight")}
    return runs


@pytest.mark.timeout(90)
def test_gpipe_and_1f1b_agree_and_send_what_theory_says(run_tp, tmp_path):
    per_rank = run_tp(_both_schedules, 1, str(tmp_path), pp=4)
    r = per_rank[0]
    g, f = r[("gpipe", 4)], r[("1f1b", 4)]
    for a, b in zip(g["losses"] + g["grad_norms"], f["losses"] + f["grad_norms"]):
        assert math.isclose(a, b, rel_tol=1e-5)
    assert all(run["theory_ok"] for rank in per_rank for run in rank.values())
    # activations held at once on stage s: GPipe all m, 1F1B at most p - s
    assert [rank[("gpipe", 4)]["max_inflight"] for rank in per_rank] == [4, 4, 4, 4]
    assert [rank[("1f1b", 4)]["max_inflight"] for rank in per_rank] == [4, 3, 2, 1]
    assert [rank[("1f1b", 2)]["max_inflight"] for rank in per_rank] == [2, 2, 2, 1]
    for m in (4, 2):  # what the planner prices (spec.theory.peak_in_flight), measured
        assert [rank[("1f1b", m)]["max_inflight"] for rank in per_rank] == \
            [peak_in_flight(s, 4, 1, m) for s in range(4)]
    for run in r.values():  # measured idle/busy, next to the theory (not asserted equal)
        assert run["bubble"] > 0 and math.isfinite(run["bubble"])
    assert f["bubble_theory"] == bubble_theory(4, 4) == 0.75
    assert r[("1f1b", 2)]["bubble_theory"] == 1.5


def _tied_after_training(mesh, out: str) -> dict:
    cfg = _cfg(out, tp=mesh.tp_size, pp=mesh.pp_size, steps=4, lr=1e-2)
    model = train_model(cfg, mesh)
    before = tied_params(model)[0].detach().clone()
    train(cfg, mesh, model=model)
    (p,) = tied_params(model)
    return dict(stage=mesh.pp_rank, tp=mesh.tp_rank, before=before, after=p.detach().clone(),
                is_head=bool(meta_of(p).tied_to))


@pytest.mark.timeout(60)
def test_tied_embedding_and_head_stay_equal_across_stages(run_tp, tmp_path):
    r = run_tp(_tied_after_training, 2, str(tmp_path), pp=2)  # ranks 0,1: stage 0; 2,3: stage 1
    for t in range(2):
        first, last = r[t], r[2 + t]
        assert (first["stage"], last["stage"], first["tp"], last["tp"]) == (0, 1, t, t)
        assert last["is_head"] and not first["is_head"]
        assert torch.equal(first["before"], last["before"])  # same initial matrix
        assert not torch.equal(first["before"], first["after"])  # it was trained
        assert torch.allclose(first["after"], last["after"], atol=1e-6)  # and stayed tied
