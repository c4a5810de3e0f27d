"""`tpkit.comm.incarnation`: the ranks of a restarted torchrun job agree on a fresh store
prefix, whatever an earlier incarnation left in the shared store and in whatever order
they start (threads on one TCPStore stand in for the ranks). Opening the store: a port
another run holds, or no store at the address, is one line naming rank and address."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tpkit.comm.incarnation import ROOT, agree_prefix, env_store
from tpkit.spec.errors import RunFailed, UserError

TIMEOUT = timedelta(seconds=60)


def _store(port: int = 0, master: bool = True) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=master, timeout=TIMEOUT)


def _agree(server: dist.TCPStore, world: int, delays: dict[int, float]) -> dict[int, str]:
    got: dict[int, str] = {}

    def rank(r: int) -> None:
        time.sleep(delays.get(r, 0.0))
        got[r] = agree_prefix(_store(server.port, False), r, world, TIMEOUT)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(got) == list(range(world)), "a rank did not finish the handshake"
    return got


@pytest.mark.timeout(120)
def test_restarted_ranks_agree_on_a_fresh_prefix_in_any_start_order():
    server = _store()
    first = _agree(server, 3, {})
    assert len(set(first.values())) == 1 and first[0].startswith(ROOT)
    # the next incarnation: rank 0 last (it finds hellos to answer), then rank 0 first
    # (it answers the previous incarnation's stale hellos before the new ones arrive)
    second = _agree(server, 3, {0: 0.3})
    third = _agree(server, 3, {1: 0.3, 2: 0.5})
    assert len(set(second.values())) == len(set(third.values())) == 1
    assert len({first[0], second[0], third[0]}) == 3


@pytest.mark.timeout(60)
def test_rank_0_names_the_ranks_that_never_joined():
    server = _store()
    with pytest.raises(UserError, match=r"rank 0: ranks \[1, 2\] did not join this "
                                        r"incarnation in 1 s"):
        agree_prefix(server, 0, 3, timedelta(seconds=1))


def test_two_runs_racing_for_one_port_and_a_store_that_never_answers(monkeypatch):
    with socket.socket() as other:  # another run's store, listening on the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        with pytest.raises(UserError, match=rf"^rank 0: the run's store cannot listen on "
                           rf"127.0.0.1:{port}: another process holds the port"):
            env_store(timedelta(seconds=5))
    monkeypatch.setenv("RANK", "1")  # the port is free now: nobody answers there
    with pytest.raises(RunFailed, match=rf"^rank 1: no store answered at 127.0.0.1:{port} in 1 s"):
        env_store(timedelta(seconds=1))
