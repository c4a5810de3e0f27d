"""`--compile`: compiled blocks against eager ones at tp=1 and tp=2 (loss and every
gradient <= 1e-5 in float32), the collectives still recorded as the theory says, and
no recompilation after the first steps (Dynamo's own graph counter).

The tests compile with the "aot_eager" backend (Dynamo + AOTAutograd, the graphs and
graph breaks of --compile without Inductor's C++ code generation, which takes minutes
on a loaded 2-core machine); `benchmarks/compile_speedup.py` checks Inductor's result
against eager before it times a step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import max_diff
from tpkit.model import Transformer
from tpkit.spec import get_preset, theory
from tpkit.train.compile import compiled_graphs

B, S = 2, 16


def steps(mesh, compiled: bool, n: int, chunk: int = 0) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # a pool process keeps them from earlier tests
    cfg = replace(get_preset("gpt2-tiny"), num_layers=3)
    model = Transformer(cfg, mesh, seed=5, loss_chunk=chunk,
                        compile_backend="aot_eager" if compiled else None)
    compiled_blocks = [b for b in model.layers.values() if b._compiled_call_impl is not None]
    assert len(compiled_blocks) == (3 if compiled else 0)
    gen = torch.Generator().manual_seed(0)
    graphs, losses = [], []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        mesh.ledger.clear()
        model.zero_grad()
        loss = model.loss(model(ids), ids.roll(-1, 1))
        loss.backward()
        losses.append(loss.item())
        graphs.append(compiled_graphs())
    counts = mesh.ledger.counts(phase="forward") + mesh.ledger.counts(phase="backward")
    return dict(losses=losses, graphs=graphs, counts=counts, names=list(model.state_dict()),
                grads={k: p.grad.clone() for k, p in model.named_parameters()})


@pytest.mark.parametrize("tp,chunk", [(1, 0), (2, 0), (2, 12)])
def test_compiled_blocks_equal_eager_and_do_not_recompile(run_tp, tp, chunk):
    """chunk=12: the chunked loss (chunks of 12, 12, 8 tokens) compiled as well."""
    eager = run_tp(steps, tp, False, 4, chunk)
    comp = run_tp(steps, tp, True, 4, chunk)
    h = get_preset("gpt2-tiny").hidden
    for e, c in zip(eager, comp):
        assert max(abs(a - b) for a, b in zip(e["losses"], c["losses"])) <= 1e-5
        for k, g in e["grads"].items():
            assert max_diff(c["grads"][k], g) <= 1e-5, k
        assert c["names"] == e["names"]  # compiled in place: checkpoints see the same names
        assert c["counts"] == theory.as_counter(theory.stage(b=B, s=S, h=h, tp=tp, num_layers=3,
                                                             loss_chunk=chunk))
        assert c["graphs"][0] > 0 and e["graphs"] == [0] * 4
        assert c["graphs"][1] == c["graphs"][3], c["graphs"]  # nothing built after step 2


def train_run(mesh, out: str, compiled: bool) -> dict:
    from tpkit.train.config import TrainConfig
    from tpkit.train.loop import train
    from tpkit.train.report import report

    torch._dynamo.reset()
    cfg = TrainConfig(preset="gpt2-tiny", tp=mesh.tp_size, steps=4, global_batch=4, seq=32,
                      compile=compiled, compile_backend="aot_eager", val_fraction=0.0, out=out,
                      progress=False, plot=False, checkpoint=False)
    r = train(cfg, mesh)
    return dict(losses=r.losses, theory_ok=r.theory_ok, text=report(r, []))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_compile_matches_eager_and_prints_compile_time(run_tp, tmp_path):
    eager = run_tp(train_run, 2, str(tmp_path / "e"), False)
    comp = run_tp(train_run, 2, str(tmp_path / "c"), True)
    for e, c in zip(eager, comp):
        assert c["theory_ok"] and max(abs(a - b) for a, b in zip(e["losses"], c["losses"])) <= 1e-5
    assert "--compile (aot_eager): first step" in comp[0]["text"]
    assert "--compile" not in eager[0]["text"]


def test_unknown_backend_is_named_before_training():
    from tpkit.train.config import TrainConfig

    problems = TrainConfig(compile=True, compile_backend="nope").problems()
    assert any("compile_backend='nope' is not one of" in p and "inductor" in p
               for p in problems)
    assert TrainConfig(compile_backend="nope").problems() == []  # only read with --compile
