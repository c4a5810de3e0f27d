"""One store prefix per incarnation of a torchrun job, agreed by every rank.

torchrun's agents share one TCPStore with their workers for the whole job. After
a restart (`--max-restarts`) it still holds the dead incarnation's keys (the gloo
addresses of the default group), so each incarnation must use fresh key names.
TORCHELASTIC_RESTART_COUNT cannot name them: each agent counts only its own
failures, so when one node's worker dies, that node's agent counts a restart and
the other node's agent (which restarts because a node waits) does not, and the
two nodes' new workers would look under different names and never meet.

Instead rank 0 draws a random token and hands it to each other rank in reply to
that rank's own random nonce, so a rank never takes an earlier incarnation's token:

    rank r > 0:  set hello/r = n_r;  token = get reply/n_r (waits);  set token/joined/r
    rank 0:      until every token/joined/r exists: set reply/hello[r] = token

`env_store` opens that store from torchrun's environment, a port another run holds, or
a store that never answers, said in one line.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from tpkit.spec.errors import RunFailed, UserError

ROOT = "tpkit/incarnation"


def env_store(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """(store, rank, world) from torchrun's environment (MASTER_ADDR, MASTER_PORT): the
    agents' store, or one that rank 0 serves. One line when rank 0 cannot listen on the
    port (another run holds it: two runs racing for one port) or another rank gets no
    answer there within `timeout`."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    me = f"rank {os.environ.get('RANK', '?')}"
    try:
        return next(dist.rendezvous("env://", timeout=timeout))
    except dist.DistNetworkError as e:
        if "EADDRINUSE" in str(e):
            raise UserError(f"{me}: the run's store cannot listen on {where}: another "
                            f"process holds the port (another run?); give each run its "
                            f"own port (torchrun --master-port, --rdzv-endpoint)") from None
        raise RunFailed(f"{me}: no store answered at {where} in "
                        f"{timeout.total_seconds():.0f} s (its host down or unreachable, "
                        f"or rank 0 not started)") from None


def agree_prefix(store: dist.Store, rank: int, world: int, timeout: timedelta) -> str:
    """A key prefix that every rank of this incarnation returns and no earlier one used."""
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{ROOT}/hello/{rank}", nonce)
        try:
            token = store.get(f"{ROOT}/reply/{nonce}").decode()
        except dist.DistStoreError as e:
            raise UserError(f"rank {rank}: no word from rank 0 of this incarnation in "
                            f"{timeout.total_seconds():.0f} s (it did not start?)") from e
        store.set(f"{ROOT}/{token}/joined/{rank}", "1")
        return f"{ROOT}/{token}"
    return f"{ROOT}/{_serve(store, world, timeout)}"


def _serve(store: dist.Store, world: int, timeout: timedelta) -> str:
    """Rank 0: answer every rank's hello with a fresh token until each one joined."""
    token, answered, pending = uuid.uuid4().hex, {}, set(range(1, world))
    deadline, pause = time.monotonic() + timeout.total_seconds(), 0.005
    while pending:
        for r in sorted(pending):
            if store.check([f"{ROOT}/{token}/joined/{r}"]):
                pending.discard(r)
            elif store.check([f"{ROOT}/hello/{r}"]):
                nonce = store.get(f"{ROOT}/hello/{r}")
                if answered.get(r) != nonce:  # new, or an earlier incarnation's: answer it
                    store.set(f"{ROOT}/reply/{nonce.decode()}", token)
                    answered[r] = nonce
        if pending and time.monotonic() > deadline:
            raise UserError(f"rank 0: ranks {sorted(pending)} did not join this incarnation "
                            f"in {timeout.total_seconds():.0f} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.2)
    return token
