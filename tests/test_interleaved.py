"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2): v chunks per stage, bubble
(p-1)/(v m) instead of (p-1)/m, the same step as the single-process run.

Checked here: the per-stage program never deadlocks and, with unit costs, leaves
exactly (p-1)/(v m) idle per busy (an event simulation); 10 training steps at
(tp, pp) = (1, 1), (1, 2), (2, 2) with v=2 give the single-process losses, gradient
norms and validation loss (relative 1e-4); bad input is refused before training,
naming the numbers. The wall-clock bubble is measured by
benchmarks/pipeline_bubble.py (a benchmark: timings are never asserted in tests).
"""

from __future__ import annotations

import pytest
import torch

from tpkit.cli import main
from tpkit.mesh import ParallelMesh
from tpkit.model import Transformer
from tpkit.parallel import (
    interleaved_order,
)
from tpkit.plan.layout import Layout
from tpkit.plan.memory import chunk_layers, layers_in_flight
from tpkit.spec import get_preset
from tpkit.spec.theory import bubble_theory, peak_in_flight, peak_layers_in_flight
from tpkit.train.config import TrainConfig
from tpkit.train.loop import train


def _simulated_bubble(p: int, v: int, m: int, tf: float = 1.0, tb: float = 2.0) -> float:
    """Run every stage's program with chunk costs tf/v, tb/v; (span - busy) / busy."""
    progs = [interleaved_order(s, p, v, m) for s in range(p)]
    done: dict[tuple, float] = {}  # (kind, virtual stage, micro-batch) -> finish time
    pos, clock = [0] * p, [0.0] * p
    while any(pos[s] < len(progs[s]) for s in range(p)):
        moved = False
        for s in (s for s in range(p) if pos[s] < len(progs[s])):
            kind, c, i = progs[s][pos[s]]
            j = c * p + s  # virtual stage
            dep = (("F", j - 1, i) if j else None) if kind == "F" else \
                (("B", j + 1, i) if j < p * v - 1 else ("F", j, i))
            if dep is not None and dep not in done:
                continue
            clock[s] = max(clock[s], done.get(dep, 0.0)) + (tf if kind == "F" else tb) / v
            done[(kind, j, i)], pos[s], moved = clock[s], pos[s] + 1, True
        assert moved, f"deadlock at p={p} v={v} m={m}"
    return (max(clock) - m * (tf + tb)) / (m * (tf + tb))


def test_order_never_deadlocks_and_leaves_the_theoretical_bubble():
    for p in (2, 3, 4):
        for v in (1, 2, 3):
            for m in (p, 2 * p, 4 * p):
                ops = interleaved_order(0, p, v, m)
                assert sorted(ops) == sorted((k, c, i) for k in "FB" for c in range(v)
                                             for i in range(m))
                got = _simulated_bubble(p, v, m)
                assert abs(got - bubble_theory(p, m, v)) < 1e-9, (p, v, m, got)


def test_the_planners_in_flight_count_is_the_schedules():
    """Walk each stage's program: the most chunk activations it holds at once is
    `peak_in_flight`, and the planner's layers in flight are that times the layers of a
    chunk (the 1F1B case, v = 1, is measured in a real run: tests/test_pipeline.py)."""
    for p, v, m in [(2, 2, 2), (3, 2, 6), (4, 3, 8), (4, 2, 4), (16, 8, 32), (8, 4, 8)]:
        lay = Layout(1, p, 1, 1, interleave=v)
        for s in range(p):
            held = peak = 0
            for kind, _, _ in interleaved_order(s, p, v, m):
                held += 1 if kind == "F" else -1
                peak = max(peak, held)
            assert peak == peak_in_flight(s, p, v, m), (p, v, m, s)
            assert layers_in_flight(2 * p * v, lay, s, m) == 2 * peak
            assert peak_layers_in_flight(s, p, (2,) * v, m) == 2 * peak
    assert peak_in_flight(1, 16, 8, 32) == 141  # the 405B layout of docs/planner.md


def test_llama3s_embedding_and_output_chunks_hold_no_layer_in_flight():
    """With lighter ends the first chunk of the first stage holds only the embedding and
    the last chunk of the last stage only the output: the chunk forwards those stages
    hold at the peak are not all layers. Walked by hand from the order: stage 0's warm-up
    runs chunk 0 for 16 + 15 of its 143 forwards; stage 15 holds chunks 0-6 of 16
    micro-batches when chunk 0 of the next 16 starts."""
    lay = Layout(8, 16, 64, 1, True, "none", 2, 8, 1, lighter_ends=True)
    assert chunk_layers(126, lay, 0) == (0,) + (1,) * 7
    assert chunk_layers(126, lay, 15) == (1,) * 7 + (0,)
    first = [c for kind, c, _ in interleaved_order(0, 16, 8, 32)[:peak_in_flight(0, 16, 8, 32)]]
    assert layers_in_flight(126, lay, 0, 32) == len(first) - first.count(0) == 143 - 31
    assert layers_in_flight(126, lay, 1, 32) == peak_in_flight(1, 16, 8, 32)
    assert layers_in_flight(126, lay, 15, 32) == 7 * 16 + 1


# -- equivalence with the single-process run ----------------------------------------------
def _cfg(out: str, **kw) -> TrainConfig:
    base = dict(preset="gpt2-tiny", steps=10, micro_batches=2, global_batch=8, seq=32,
                lr=3e-3, warmup=3, clip=0.5, val_fraction=0.05, eval_every=5, eval_batches=1,
                out=out, progress=False, plot=False, checkpoint=False)
    return TrainConfig(**{**base, **kw})


def _train(mesh, cfg: TrainConfig) -> dict:
    r = train(cfg, mesh)
    return dict(losses=r.losses, norms=r.grad_norms, val=r.val_loss, theory_ok=r.theory_ok)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(ParallelMesh.single(), _cfg(str(tmp_path_factory.mktemp("ref"))))
    finally:
        torch.set_num_threads(threads)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (2, 2)])
def test_interleaved_matches_single_process(run_tp, reference, tmp_path, tp, pp):
    cfg = _cfg(str(tmp_path), tp=tp, pp=pp, schedule="interleaved", virtual_stages=2)
    results = run_tp(_train, tp, cfg, pp=pp)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert _rel(results[0]["losses"], reference["losses"]) <= 1e-4
    assert _rel(results[0]["norms"], reference["norms"]) <= 1e-4
    assert _rel([results[0]["val"]], [reference["val"]]) <= 1e-4  # forward-only, chunked
    assert all(r["theory_ok"] for r in results)  # v activations per micro-batch and stage


# -- bad input -----------------------------------------------------------------------------
def test_bad_input_is_refused_naming_the_numbers(capsys):
    cfg = TrainConfig(pp=2, schedule="interleaved", virtual_stages=2, micro_batches=3,
                      global_batch=6)
    assert "micro_batches=3 is not a multiple of pp=2" in "; ".join(cfg.problems())
    cfg = TrainConfig(pp=2, schedule="interleaved", virtual_stages=4, micro_batches=2)
    assert "pp*virtual_stages = 2*4 = 8 chunks is more than num_layers=4" in \
        "; ".join(cfg.problems())
    cfg = TrainConfig(pp=2, virtual_stages=2, micro_batches=2)
    assert "virtual_stages=2 needs schedule='interleaved'" in "; ".join(cfg.problems())
    assert "virtual_stages=0 must be a positive integer" in \
        "; ".join(TrainConfig(virtual_stages=0).problems())
    with pytest.raises(ValueError, match=r"pp\*virtual_stages = 1\*5 = 5"):
        Transformer(get_preset("gpt2-tiny"), ParallelMesh.single(), virtual_stages=5)
    assert main(["train", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                 "--micro-batches", "3", "--global-batch", "6", "--steps", "1"]) == 2
    assert "micro_batches=3 is not a multiple of pp=2" in capsys.readouterr().err
