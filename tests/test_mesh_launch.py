"""The mesh's rank grid and groups, the locality check, and `spawn`'s error handling."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from tpkit.commands.train import cross_node_price
from tpkit.launch import SpawnError, spawn
from tpkit.mesh import ParallelMesh, TopologyWarning
from tpkit.spec.grid import check_sizes, coord_of, group_ranks, rank_grid


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (2, 2, 1), (2, 2, 2), (4, 2, 1), (1, 4, 2)])
def test_grid_is_tp_innermost_and_groups_partition_the_world(tp, pp, dp):
    world = tp * pp * dp
    grid = rank_grid(tp, pp, dp)
    for d in range(dp):
        for p in range(pp):
            ranks = grid[d][p]
            assert ranks == list(range(ranks[0], ranks[0] + tp))  # a run of consecutive ranks
            for t, r in enumerate(ranks):
                c = coord_of(r, tp, pp)
                assert (c.dp, c.pp, c.tp) == (d, p, t)
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dp), ("mp", tp * pp)):
        groups = group_ranks(kind, tp, pp, dp)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    # pp groups step by tp, dp groups by tp*pp
    assert group_ranks("pp", tp, pp, dp)[0] == tuple(range(0, tp * pp, tp))
    assert group_ranks("dp", tp, pp, dp)[0] == tuple(range(0, world, tp * pp))
    assert group_ranks("dp_cp", tp, pp, dp) == group_ranks("dp", tp, pp, dp)  # cp=1


@pytest.mark.parametrize("tp,pp,dp,cp", [(1, 1, 2, 2), (2, 1, 1, 2), (2, 2, 2, 2), (1, 2, 1, 4)])
def test_cp_sits_right_outside_tp_and_dp_cp_holds_the_same_weights(tp, pp, dp, cp):
    world = tp * pp * dp * cp
    for r in range(world):  # rank = ((dp * pp + pp_i) * cp + cp_i) * tp + tp_i
        c = coord_of(r, tp, pp, cp)
        assert r == ((c.dp * pp + c.pp) * cp + c.cp) * tp + c.tp
    for kind, size in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp), ("dp_cp", dp * cp),
                       ("mp", tp * pp)):
        groups = group_ranks(kind, tp, pp, dp, cp)
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        assert all(len(g) == size for g in groups), kind
    assert group_ranks("cp", tp, pp, dp, cp)[0] == tuple(range(0, tp * cp, tp))  # tp apart
    for g in group_ranks("dp_cp", tp, pp, dp, cp):  # same (pp, tp); replica * cp + cp index
        coords = [coord_of(r, tp, pp, cp) for r in g]
        assert len({(c.pp, c.tp) for c in coords}) == 1
        assert [c.dp * cp + c.cp for c in coords] == list(range(dp * cp))


def test_cp_mesh_on_real_processes(pools):
    facts = pools.run(_mesh_facts, 4, mesh=dict(tp=1, pp=2, dp=1, cp=2))
    assert [f["cp"] for f in facts] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [f["cp_rank"] for f in facts] == [0, 1, 0, 1]
    assert [f["pp"] for f in facts] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [f["dp_cp"] for f in facts] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [f["dp"] for f in facts] == [(0,), (1,), (2,), (3,)]
    assert facts[0]["layout"] == dict(tp=1, pp=2, dp=1, cp=2)


def test_sizes_must_multiply_to_world():
    with pytest.raises(ValueError, match=r"tp\*pp\*dp = 2\*2\*2 = 8 does not equal world_size=4"):
        check_sizes(4, 2, 2, 2)
    with pytest.raises(ValueError, match="world_size=1"):
        ParallelMesh(2, 1, 1)
    with pytest.raises(ValueError, match=r"tp\*pp\*dp\*cp = 1\*1\*2\*2 = 4 does not equal "
                                         r"world_size=2"):
        check_sizes(2, 1, 1, 2, 2)


def test_tp_group_spanning_nodes_warns_with_reason_or_errors():
    with pytest.warns(TopologyWarning, match=r"spans 2 nodes of 2 ranks.*keep tp <= 2"):
        _mesh_without_groups(4, 2, strict=False)
    with pytest.raises(ValueError, match="all-reduces the activations 4 times per layer"):
        _mesh_without_groups(4, 2, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _mesh_without_groups(2, 2, strict=False)  # tp=2 inside a node of 2: silent


def test_train_command_prices_a_tp_group_spanning_nodes_with_the_planner():
    assert cross_node_price(2, 1, 2, 2) is None  # tp=2 inside nodes of 2
    assert re.search(r"Predicted on H100.*tp=4 spans 2 nodes.*ms per layer",
                     cross_node_price(4, 1, 1, 2))


def _mesh_without_groups(tp, per_node, strict):
    # the locality check runs before any process group is touched
    m = ParallelMesh.__new__(ParallelMesh)
    m.tp_size, m.pp_size, m.dp_size, m.cp_size, m.ranks_per_node = tp, 4 // tp, 1, 1, per_node
    m._check_locality(strict)
    return m


def _mesh_facts(mesh):
    return dict(rank=mesh.rank, tp=mesh.tp_group.ranks, pp=mesh.pp_group.ranks,
                dp=mesh.dp_group.ranks, tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank,
                cp=mesh.cp_group.ranks, cp_rank=mesh.cp_rank, dp_cp=mesh.dp_cp_group.ranks,
                layout=mesh.layout)


def test_groups_on_real_processes(pools):
    facts = pools.run(_mesh_facts, 4, mesh=dict(tp=2, pp=2, dp=1))
    assert [f["tp"] for f in facts] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [f["pp"] for f in facts] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [f["pp_rank"] for f in facts] == [0, 0, 1, 1]
    facts = pools.run(_mesh_facts, 4, mesh=dict(tp=2, pp=1, dp=2))
    assert [f["dp"] for f in facts] == [(0, 2), (1, 3), (0, 2), (1, 3)]


def _raise_on_rank_one(rank):
    if rank == 1:
        raise ValueError("num_heads=5 is not divisible by tp=2")
    import torch.distributed as dist

    dist.barrier()  # rank 0 would wait forever for rank 1
    return rank


def _die_on_rank_zero(rank):
    import os

    if rank == 0:
        os._exit(3)
    import torch.distributed as dist

    dist.barrier()


def _sum_ranks(rank, scale):
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return scale * t.item()


def test_spawn_returns_per_rank_results():
    assert spawn(_sum_ranks, 2, 10.0, timeout=60) == [10.0, 10.0]


def test_a_raising_rank_reaches_the_parent_within_the_timeout():
    with pytest.raises(SpawnError, match="rank 1 raised ValueError: num_heads=5") as info:
        spawn(_raise_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert isinstance(info.value.original, ValueError)


def test_a_dead_rank_is_named():
    with pytest.raises(SpawnError, match=r"rank 0 died \(exit code 3\)"):
        spawn(_die_on_rank_zero, 2, timeout=60)


def test_the_stuck_rank_named_is_the_one_the_timed_out_ranks_suspect():
    """A wait chain (tp2 x pp2, rank 2 stopped): rank 0 times out on its receive from
    rank 2 and rank 3 on its all-reduce with rank 2, while rank 1, waiting on rank 3,
    has not timed out yet: two ranks are silent, and the one named is rank 2 (the
    suspect), not the lowest silent rank."""
    import pickle

    from tpkit.comm.failure import CollectiveFailed
    from tpkit.launch import WorkerPool

    def timed_out(me, op, group, ranks, peer=None):
        e = CollectiveFailed(op, group, ranks, me, "pipeline", "backward", 10.0,
                             "Timed out waiting 10000ms", peer=peer, step=3)
        return (type(e).__name__, str(e), "", pickle.dumps(e), True)

    pool = WorkerPool(4)  # not started: no process, none dead
    errors = {0: timed_out(0, "recv", "pp", (0, 2), peer=2),
              3: timed_out(3, "all_reduce", "tp", (2, 3))}
    err = pool._root_cause(errors, {})
    assert err.rank == 2 and str(err).startswith("rank 2 stopped making progress"), err
    assert "then rank 0: recv over pp [0, 2]" in str(err)
    # no suspect among the silent ones (a group-wide wait): the lowest silent rank
    err = pool._root_cause({0: timed_out(0, "all_reduce", "mp", (0, 1, 2, 3))}, {})
    assert err.rank == 1, err
