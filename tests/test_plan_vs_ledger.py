"""The planner prices exactly the collectives a real run sends.

For several (tp, sp, recompute) layouts, one layer's tensor-parallel collectives are
taken three ways and must agree: the planner's list (`plan.simulate.layer_collectives`,
what it prices), `spec.theory.layer`, and the ledger of a real forward + backward on
gloo processes (a 2-layer model's records minus a 1-layer model's: one layer, nothing
else). The planner's per-layer tp time is then the price of the recorded list.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from tpkit.model import Transformer
from tpkit.plan import cost, get_hardware
from tpkit.plan.memory import Precision
from tpkit.plan.simulate import Layout, collectives_time, layer_collectives, tp_collectives
from tpkit.spec import get_preset, theory

B, S = 2, 8
CFG = get_preset("gpt2-tiny")
# (tp, sp, recompute); the runtime's recompute is all or nothing ("full"); "selective"
# recomputes only the attention core, which sends nothing: the runtime without recompute
LAYOUTS = [(2, False, "none"), (2, True, "none"), (2, True, "full"), (4, True, "selective"),
           (4, False, "full"), (4, True, "full")]


def tp_counts_by_depth(mesh, sp: bool, full_recompute: bool) -> list[Counter]:
    """tp-group ledger counts of one training forward + backward, at 1 and 2 layers."""
    out = []
    ids = torch.randint(0, CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    for layers in (1, 2):
        mesh.ledger.clear()
        model = Transformer(replace(CFG, num_layers=layers), mesh, seed=3,
                            sequence_parallel=sp, recompute=full_recompute)
        model.train()
        model.loss(model(ids), ids).backward()
        out.append(mesh.ledger.counts(group="tp"))
    return out


def one_layer(counts: list[Counter]) -> Counter:
    """What the second layer added: the per-layer collectives as the ledger saw them."""
    one, two = counts
    assert all(two[k] >= one[k] for k in one), (one, two)
    return Counter({k: two[k] - one[k] for k in two if two[k] != one[k]})


@pytest.mark.parametrize("tp,sp,recompute", LAYOUTS)
def test_planner_layer_collectives_equal_theory_and_the_ledger(run_tp, tp, sp, recompute):
    lay = Layout(tp=tp, pp=1, dp=1, micro_batch=B, sp=sp, recompute=recompute)
    planned = layer_collectives(CFG, S, lay)
    assert theory.as_counter(planned) == theory.as_counter(
        theory.layer(B, S, CFG.hidden, tp, sp, recompute))
    for counts in run_tp(tp_counts_by_depth, tp, sp, recompute == "full"):
        assert one_layer(counts) == theory.as_counter(planned), (tp, sp, recompute)
    # and the planner's time for a layer is the price of what the ledger recorded
    hw, prec = replace(get_hardware("h100"), devices_per_node=8), Precision()
    recorded = [theory.Expect(op, phase, n, k) for (op, phase, n), k in one_layer(counts).items()]
    priced = collectives_time(recorded, prec.activation, tp, cost.link_for(tp, hw))
    assert sum(tp_collectives(CFG, S, lay, hw, prec).values()) == pytest.approx(priced)


def test_sequence_parallel_costs_what_the_all_reduces_cost():
    """2 AG + 2 RS each way move the bytes of 2 all-reduces each way: same ring time
    (the bug this guards against priced SP at half)."""
    c, hw, prec = get_preset("llama3-70b"), get_hardware("h100"), Precision()
    base = Layout(tp=8, pp=1, dp=1, micro_batch=1)
    plain = tp_collectives(c, 4096, base, hw, prec)
    with_sp = tp_collectives(c, 4096, replace(base, sp=True), hw, prec)
    assert with_sp == pytest.approx(plain)
    assert with_sp["tp_comm_fwd"] > 0
