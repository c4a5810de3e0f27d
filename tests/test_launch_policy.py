"""`tpkit.launch.launch`: the one place a command's ranks are decided (alone, spawned,
torchrun's, rank 0 here), its setup entered once where the decision is taken, and the
followers that run instead of `fn` on every rank but a tp group's first."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from tpkit.launch import decided_by_rank0, is_rank0, launch, under_torchrun, world_here
from tpkit.spec.errors import UserError


def _alone(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_where_this_process_is(monkeypatch):
    _alone(monkeypatch)
    assert (under_torchrun(), is_rank0(), world_here()) == (False, True, None)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not under_torchrun()  # torchrun sets both
    monkeypatch.setenv("RANK", "3")
    assert (under_torchrun(), is_rank0(), world_here()) == (True, False, 4)
    monkeypatch.setenv("RANK", "0")
    assert is_rank0()


def test_one_rank_runs_here_inside_its_setup(monkeypatch):
    _alone(monkeypatch)
    seen = []

    @contextmanager
    def setup(mesh):
        seen.append(("enter", mesh))
        yield ("chosen",)
        seen.append(("exit", mesh))

    def fn(mesh, a, b):
        seen.append(("fn", mesh.world_size, a, b))
        return a + b

    assert launch(fn, "x", ranks=1, mesh=dict(tp=1), setup=setup) == "xchosen"
    assert seen == [("enter", None), ("fn", 1, "x", "chosen"), ("exit", None)]
    assert launch(fn, "y", "z", ranks=1, mesh=dict(tp=1), every=True) == ["yz"]
    # a lone rank 0 leads: the followers' function is not run
    assert launch(fn, "a", "b", ranks=1, mesh=dict(tp=1), follow=(_follower, ())) == "ab"


def test_rank0_decides_here_when_alone():
    assert decided_by_rank0(None, lambda v: v * 2, 21) == 42

    def refuse():
        raise UserError("no")

    with pytest.raises(UserError, match="no"):
        decided_by_rank0(None, refuse)


def _lead(mesh, word):
    return ("lead", mesh.rank, word)


def _follower(mesh, *args):
    return ("followed", mesh.rank, args)


@pytest.mark.slow
def test_spawned_ranks_follow_and_rank0_leads(monkeypatch):
    _alone(monkeypatch)
    out = launch(_lead, "hi", ranks=2, mesh=dict(tp=2, comm="gloo"), every=True,
                 follow=(_follower, (7,)))
    assert out == [("lead", 0, "hi"), ("followed", 1, (7,))]
