"""ZeRO-1 moves the bytes of one all-reduce, not 1.5x: the gradients are reduce-scattered
(each rank keeps the slice it updates), the updated weights all-gathered; the ledger of a
real step equals `tpkit.spec.theory.data_parallel`, the planner prices that same list,
and the sharded update stays AdamW's exactly."""

from __future__ import annotations

import pytest
import torch

from tpkit.plan import cost
from tpkit.plan.data_parallel import dp_time, step_collectives
from tpkit.plan.hardware import Link
from tpkit.plan.layout import Layout
from tpkit.spec import theory

N_MATRIX, N_VECTOR = 5 * 7 + 7 * 3, 7 + 3  # Linear(5, 7) + Linear(7, 3): decayed, undecayed


def _padded(n: int, dp: int) -> int:
    return -(-n // dp) * dp


def _zero_step(mesh) -> dict:
    from tpkit.parallel import ZeroAdamW, allreduce_grads
    from tpkit.train.optim import param_groups

    torch.manual_seed(0)  # replicas start equal
    nets = [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    torch.manual_seed(1 + mesh.dp_rank)  # different data per replica
    x = torch.randn(4, 5)
    zero = ZeroAdamW(param_groups(nets[0], 0.1), mesh.dp_group, lr=0.1)
    plain = torch.optim.AdamW(param_groups(nets[1], 0.1), lr=0.1)
    records = []
    for _ in range(3):
        nets[0](x).square().sum().backward()  # no all-reduce: ZeRO-1 reduce-scatters
        mesh.ledger.clear()
        zero.step()
        records = [(r.op, r.phase, r.numel) for r in mesh.ledger.records]
        zero.zero_grad()
        nets[1](x).square().sum().backward()
        allreduce_grads(list(nets[1].parameters()), mesh.dp_group)
        plain.step()
        plain.zero_grad()
    return dict(records=records, diff=max((a - b).abs().max().item() for a, b in
                                          zip(nets[0].parameters(), nets[1].parameters())))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dp", [2, 3])
def test_zero1_step_is_reduce_scatter_plus_all_gather_and_exact(pools, dp):
    results = pools.run(_zero_step, dp, mesh=dict(tp=1, pp=1, dp=dp))
    want = theory.as_counter(theory.data_parallel(_padded(N_MATRIX, dp), dp, zero1=True)
                             + theory.data_parallel(_padded(N_VECTOR, dp), dp, zero1=True))
    for r in results:
        assert theory.as_counter([theory.Expect(*rec) for rec in r["records"]]) == want
        assert r["diff"] <= 1e-6  # the sharded update is AdamW's on all-reduced gradients


def test_zero1_ring_bytes_equal_one_all_reduce():
    """Per rank, a ring moves 2(p-1)/p n for an all-reduce and (p-1)/p n for each of
    all-gather and reduce-scatter: ZeRO-1's pair = the plain all-reduce (the old
    all-reduce + all-gather was 1.5x)."""
    ring = {"all_reduce": lambda p: 2 * (p - 1) / p, "reduce_scatter": lambda p: (p - 1) / p,
            "all_gather": lambda p: (p - 1) / p}
    n, p = 10**6, 8

    def wire(expects):
        return sum(e.count * e.numel * ring[e.op](p) for e in expects)

    assert wire(theory.data_parallel(n, p, zero1=True)) == wire(theory.data_parallel(n, p))


def test_planner_prices_the_spec_collectives_of_zero1():
    link = Link("test", bandwidth=1e11, latency=1e-5)
    params, dp = 10**9, 8
    lay = Layout(1, 1, dp, 1, zero=1)
    assert [(e.op, e.numel) for e in step_collectives(params, lay)] == \
        [("reduce_scatter", params), ("all_gather", params)]
    # fp32 gradients reduce-scattered, bf16 weights gathered, nothing hidden without overlap
    got = dp_time(params, 10, lay, link, 4, 2, m=1, fwd=0.0, bwd=0.0, overlap=False)
    assert got == pytest.approx(cost.reduce_scatter_time(4e9, dp, link)
                                + cost.all_gather_time(2e9, dp, link))
    plain = dp_time(params, 10, Layout(1, 1, dp, 1), link, 4, 2, 1, 0.0, 0.0, overlap=False)
    assert plain == pytest.approx(cost.all_reduce_time(4e9, dp, link))
    # with overlap the reduce-scatter hides behind backward, the all-gather does not
    hidden = dp_time(params, 10, lay, link, 4, 2, m=1, fwd=0.0, bwd=10.0)
    assert hidden == pytest.approx(cost.all_gather_time(2e9, dp, link))
