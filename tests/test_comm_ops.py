"""The conjugate operators (docs/architecture.md), each forward and backward, on 2 ranks:

    copy_to_tp: identity / all-reduce          reduce_from_tp: all-reduce / identity
    scatter_to_tp: own slice / all-gather      gather_from_tp: all-gather / own slice
    scatter_to_sp: own seq slice / all-gather  gather_from_sp: all-gather / reduce-scatter
    reduce_scatter_to_sp: reduce-scatter / all-gather
"""

from __future__ import annotations

import pytest
import torch

from tpkit.comm import ops

B, S, H = 2, 4, 6


def rank_tensor(r: int, shape) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + 100 * r


def apply(mesh, name: str):
    g, r = mesh.tp_group, mesh.tp_rank
    x = rank_tensor(r, (B, S, H)).requires_grad_()
    y = getattr(ops, name)(x, g)
    gy = rank_tensor(r + 7, y.shape)  # a different upstream gradient on each rank
    y.backward(gy)
    return y.detach(), x.grad, [(rec.op, rec.phase) for rec in mesh.ledger.records]


def expected(name: str, tp: int):
    xs = [rank_tensor(r, (B, S, H)) for r in range(tp)]
    gys_like = lambda shape: [rank_tensor(r + 7, shape) for r in range(tp)]  # noqa: E731
    total = sum(xs)
    if name == "copy_to_tp":
        gys = gys_like((B, S, H))
        return xs, [sum(gys)] * tp, [("all_reduce", "backward")]
    if name == "reduce_from_tp":
        gys = gys_like((B, S, H))
        return [total] * tp, gys, [("all_reduce", "forward")]
    if name in ("scatter_to_tp", "scatter_to_sp"):
        dim = -1 if name == "scatter_to_tp" else 1
        ys = [x.chunk(tp, dim)[r] for r, x in enumerate(xs)]
        gys = gys_like(ys[0].shape)
        return ys, [torch.cat(gys, dim)] * tp, [("all_gather", "backward")]
    if name in ("gather_from_tp", "gather_from_sp"):
        dim = -1 if name == "gather_from_tp" else 1
        ys = [torch.cat(xs, dim)] * tp
        gys = gys_like(ys[0].shape)
        if name == "gather_from_tp":  # backward keeps its own slice of its own gradient
            return ys, [gy.chunk(tp, dim)[r] for r, gy in enumerate(gys)], [("all_gather",
                                                                              "forward")]
        return ys, [sum(gys).chunk(tp, dim)[r] for r in range(tp)], [
            ("all_gather", "forward"), ("reduce_scatter", "backward")]
    if name == "reduce_scatter_to_sp":
        ys = [total.chunk(tp, 1)[r] for r in range(tp)]
        gys = gys_like(ys[0].shape)
        return ys, [torch.cat(gys, 1)] * tp, [("reduce_scatter", "forward"),
                                             ("all_gather", "backward")]
    raise ValueError(name)


@pytest.mark.parametrize("name", ["copy_to_tp", "reduce_from_tp", "scatter_to_tp",
                                  "gather_from_tp", "scatter_to_sp", "gather_from_sp",
                                  "reduce_scatter_to_sp"])
def test_conjugate_pairs_forward_and_backward(run_tp, name):
    ys, gxs, ledger = expected(name, 2)
    for r, (y, gx, recs) in enumerate(run_tp(apply, 2, name)):
        assert torch.equal(y, ys[r]), (name, r)
        assert torch.equal(gx, gxs[r]), (name, r)
        assert recs == ledger, (name, recs)


def test_a_group_of_one_sends_nothing():
    from tpkit.mesh import ParallelMesh

    mesh = ParallelMesh.single()
    for name in ("copy_to_tp", "reduce_from_tp", "gather_from_sp", "reduce_scatter_to_sp"):
        y, gx, recs = apply(mesh, name)
        assert recs == [] and y.shape == (B, S, H)
