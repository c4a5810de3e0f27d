"""Overlapped data-parallel gradient averaging: buckets leave during backward, and
the result equals averaging after backward."""

from __future__ import annotations

import pytest
import torch

from tpkit.layers import ParallelMLP
from tpkit.parallel import OverlappedGradSync, allreduce_grads


def overlap(mesh, micro_batches):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[ParallelMLP(16, 32, mesh.tp_group, seed=i) for i in range(4)])
    sync = OverlappedGradSync(list(model.parameters()), mesh.dp_group, micro_batches,
                              bucket_mb=2 * 16 * 32 * 4 / 2**20)  # ~one MLP's fc1 per bucket
    g = torch.Generator().manual_seed(mesh.dp_rank)  # each replica its own data
    xs = [torch.randn(2, 3, 16, generator=g) for _ in range(micro_batches)]
    sync.arm()
    started_during_backward = []
    for x in xs:
        model(x).square().mean().backward()
        started_during_backward.append(len(sync._pending))
    sync.finish()
    overlapped = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():  # again, averaging after backward
        p.grad = None
    for x in xs:
        model(x).square().mean().backward()
    allreduce_grads(list(model.parameters()), mesh.dp_group)
    after = {n: p.grad.clone() for n, p in model.named_parameters()}
    return started_during_backward, len(sync.buckets), overlapped, after


@pytest.mark.timeout(60)
def test_buckets_start_in_the_last_backward_and_average_exactly(run_tp):
    results = run_tp(overlap, 1, 3, dp=2)
    for started, n_buckets, overlapped, after in results:
        assert n_buckets > 2
        assert started[:2] == [0, 0]  # nothing leaves before the last micro-batch
        assert started[2] == n_buckets  # every bucket left during the last backward
        for name in after:
            assert torch.allclose(overlapped[name], after[name], rtol=1e-6, atol=1e-7), name
    # and the replicas agree
    for name in results[0][2]:
        assert torch.equal(results[0][2][name], results[1][2][name])
