"""Rank 0's serving loop: step the engine while there is work, send a heartbeat to the
tp workers while there is none, watch the workers, and end cleanly.

    line = serve_loop(engine, stop, peers, drain_s=5)   # None, or "rank 1 died (...)"

`engine`: a decoder's `Engine` or an encoder's `Embedder` (the same steps and ends).

`stop` (a threading.Event, set by SIGTERM/SIGINT/SIGHUP) ends it between two steps —
never inside one, so the tp group never disagrees on the next collective: new
requests get 503, the running ones have `drain_s` seconds to finish, the rest fail with
503 "shutting down", and the workers get STOP. A worker that dies fails every request
with 503 and the loop returns the line naming the rank. A request the engine fails on
(rank 0's sampling or detokenizing of it) fails alone inside `Engine.step`; what
reaches this loop is a forward's error, after which the tp group cannot be trusted:
every request fails with 500 and the error ends the server.
"""

from __future__ import annotations

import threading
import time

from tpkit.serve.embedder import Embedder
from tpkit.serve.engine import Engine

HEARTBEAT_S = 0.5


def serve_loop(engine: Engine | Embedder, stop: threading.Event, peers=None, drain_s: float = 5.0
               ) -> str | None:
    """Run until `stop` is set (None) or a worker dies (the line naming it)."""
    runner = engine.runner
    engine.looping = True
    try:
        while not stop.is_set():
            if (line := _watch(peers)) is not None:
                return _died(engine, line)
            if engine.busy:
                engine.step()
            else:
                engine.wait_for_work(HEARTBEAT_S)
                if not engine.busy and not stop.is_set():
                    runner.lead_idle()
        engine.stop_accepting()
        deadline = time.monotonic() + drain_s
        while engine.busy and time.monotonic() < deadline:
            if (line := _watch(peers)) is not None:
                return _died(engine, line)
            engine.step()
        engine.fail_all(503, "the server is shutting down")
        runner.lead_stop()
        return None
    except Exception:
        line = _watch(peers, wait_s=3.0)  # a collective failed: which worker is gone?
        if line is None:
            engine.fail_all(500, "the server failed")
            raise
        return _died(engine, line)
    finally:
        engine.looping = False


def _watch(peers, wait_s: float = 0.0) -> str | None:
    if peers is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        line = peers.dead()
        if line is not None or time.monotonic() >= deadline:
            return line
        time.sleep(0.05)


def _died(engine: Engine | Embedder, line: str) -> str:
    engine.fail_all(503, f"a tensor-parallel worker failed: {line}")
    return line
