"""The conjugate operators (docs/architecture.md), each forward and backward, on 2 ranks:

    copy_to_tp: identity / all-reduce          reduce_from_tp: all-reduce / identity
    scatter_to_tp: own slice / all-gather      gather_from_tp: all-gather / own slice
    scatter_to_sp: own seq slice / all-gather  gather_from_sp: all-gather / reduce-scatter
    reduce_scatter_to_sp: reduce-scatter / all-gather

and the SP ones on a sequence the ranks hold in unequal parts (padded collectives).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tpkit.comm import ops
from tpkit.comm.group import CommGroup
from tpkit.spec.shapes import even_sizes

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


def _uneven_sp(mesh, s: int) -> dict:
    """The SP operators on a sequence of s tokens that tp does not divide, on the
    shared-memory group and on gloo (the same process group without the channel): each
    one's output, input gradient and ledger (op, phase, numel)."""
    shm, r = mesh.tp_group, mesh.tp_rank
    assert shm.shm is not None, shm
    out = {}
    for via, g in (("shm", shm), ("gloo", dataclasses.replace(shm, shm=None))):
        n = even_sizes(s, g.size)[r]
        for name, x in (("reduce_scatter_to_sp", rank_tensor(r, (B, s, H))),
                        ("scatter_to_sp", rank_tensor(r, (B, s, H))),
                        ("gather_from_sp", rank_tensor(r, (B, n, H)))):
            mesh.ledger.clear()
            x = x.float().requires_grad_()
            with ops.sequence(g, s):
                y = getattr(ops, name)(x, g)
            y.backward(rank_tensor(r + 7, y.shape).float())
            out[via, name] = (y.detach(), x.grad,
                              [(c.op, c.phase, c.numel) for c in mesh.ledger.records])
    return out


def _uneven_expected(name: str, tp: int, s: int, r: int):
    sizes = even_sizes(s, tp)
    at, n = sum(sizes[:r]), sizes[r]
    wire = B * tp * max(sizes) * H  # every part padded to the largest
    if name == "gather_from_sp":
        y = torch.cat([rank_tensor(q, (B, sizes[q], H)) for q in range(tp)], 1)
        gx = sum(rank_tensor(q + 7, (B, s, H)) for q in range(tp))[:, at:at + n]
        return y, gx, [("all_gather", "forward", wire), ("reduce_scatter", "backward", wire)]
    gx = torch.cat([rank_tensor(q + 7, (B, sizes[q], H)) for q in range(tp)], 1)
    if name == "scatter_to_sp":
        return rank_tensor(r, (B, s, H))[:, at:at + n], gx, [("all_gather", "backward", wire)]
    y = sum(rank_tensor(q, (B, s, H)) for q in range(tp))[:, at:at + n]
    return y, gx, [("reduce_scatter", "forward", wire), ("all_gather", "backward", wire)]


@pytest.mark.parametrize("tp,s", [(2, 7), (3, 10)])
def test_sequence_parallel_operators_on_uneven_parts_on_both_transports(pools, tp, s):
    """s=7 at tp=2 is 4 + 3, s=10 at tp=3 is 4 + 3 + 3: exact forward and backward on
    shared memory and on gloo, the ledger recording the padded collective (tp * 4 rows)."""
    for r, got in enumerate(pools.run(_uneven_sp, tp, s, mesh=dict(tp=tp, comm="shm"))):
        for (via, name), (y, gx, recs) in got.items():
            want_y, want_gx, want_recs = _uneven_expected(name, tp, s, r)
            assert torch.equal(y, want_y.float()), (via, name, r)
            assert torch.equal(gx, want_gx.float()), (via, name, r)
            assert recs == want_recs, (via, name, recs)


def test_a_part_that_is_not_this_ranks_share_of_the_sequence_is_refused():
    g = CommGroup("tp", ranks=(0, 1), rank=1, sp_seq=7)
    assert ops.sp_sizes(g, 3) == [4, 3]
    with pytest.raises(ValueError, match="holds 4 tokens; its part of a sequence of 7"):
        ops.sp_sizes(g, 4)
    assert ops.sp_sizes(CommGroup("tp", ranks=(0, 1), rank=1), 4) == [4, 4]  # no sequence
