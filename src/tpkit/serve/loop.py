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
every request fails with 500 and the error ends the server, unless it is a collective
that failed (a worker stuck until the collective timeout): then 503, the line naming it.

`tpkit serve` runs the loop in a thread of its own (`serve_watched`), so that its main
thread takes SIGTERM at once whatever a step waits on: a step still in flight once the
drain is over (a stuck worker) is given up, its requests fail with 503, the workers are
killed and one line names the stuck rank. `unwell` is /health's verdict: a worker gone
or stopped, or a step in flight longer than `STUCK_S`.
"""

from __future__ import annotations

import sys
import threading
import time

from tpkit.serve.embedder import Embedder
from tpkit.serve.engine import Engine

HEARTBEAT_S = 0.5
STUCK_S = 30.0  # a step in flight this long: /health answers 503 (a worker may be stuck)
GRACE_S = 5.0  # after the drain, how long a step in flight may still take to return


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
                _timed(engine, engine.step)
            else:
                engine.wait_for_work(HEARTBEAT_S)
                if not engine.busy and not stop.is_set():
                    _timed(engine, runner.lead_idle)
        engine.stop_accepting()
        deadline = time.monotonic() + drain_s
        while engine.busy and time.monotonic() < deadline:
            if (line := _watch(peers)) is not None:
                return _died(engine, line)
            _timed(engine, engine.step)
        engine.fail_all(503, "the server is shutting down")
        runner.lead_stop()
        return None
    except Exception as e:
        line = _watch(peers, wait_s=3.0)  # a collective failed: which worker is gone?
        if line is None and getattr(e, "run_failed", False):  # ... or stuck (timed out)
            stuck = peers.unwell() if peers is not None else None
            line = f"{stuck} ({e})" if stuck else str(e)
        if line is None:
            engine.fail_all(500, "the server failed")
            raise
        return _died(engine, line)
    finally:
        engine.looping = False


def _timed(engine: Engine | Embedder, work) -> None:
    """work(), `engine.stepping` saying since when while it runs (/health reads it)."""
    engine.stepping = time.monotonic()
    try:
        work()
    finally:
        engine.stepping = None


def unwell(engine: Engine | Embedder, peers=None) -> str | None:
    """Why this server cannot answer now (/health's 503), or None: not accepting, a worker
    gone or stopped (`Followers.unwell`), or a step in flight for over `STUCK_S`."""
    if not engine.accepting:
        return "the server is shutting down"
    if peers is not None and (line := peers.unwell()) is not None:
        return line
    since = engine.stepping
    if since is not None and (age := time.monotonic() - since) > STUCK_S:
        return f"a step has run for {age:.0f} s (over {STUCK_S:g} s): a worker may be stuck"
    return None


def serve_watched(engine: Engine | Embedder, stop: threading.Event, peers=None,
                  drain_s: float = 5.0) -> str | None:
    """`serve_loop` in a thread of its own while this one (the main thread: it takes the
    signals) waits for `stop`. Once set, the loop has `drain_s` + `GRACE_S` to end (not
    while a step waits on a worker gone or stopped); if a step is still in flight then,
    its requests fail with 503, one line names the stuck
    worker and the workers are killed (the step then fails at once). The loop's answer."""
    said: list = []

    def run() -> None:
        try:
            said.append(serve_loop(engine, stop, peers, drain_s))
        except BaseException as e:  # noqa: BLE001 - raised again in this thread
            said.append(e)

    thread = threading.Thread(target=run, name="tpkit-engine", daemon=True)
    thread.start()
    while thread.is_alive() and not stop.wait(0.25):
        pass
    deadline = time.monotonic() + drain_s + GRACE_S
    while thread.is_alive() and time.monotonic() < deadline and not (
            engine.stepping is not None and peers is not None and peers.unwell()):
        thread.join(0.25)  # (a step waiting on a stopped or dead worker: no use waiting)
    if thread.is_alive():
        _give_up(engine, peers)
        thread.join(GRACE_S)
        return None
    if isinstance(said[0], BaseException):
        raise said[0]
    return said[0]


def _give_up(engine: Engine | Embedder, peers) -> None:
    """Stopping, a step did not return: fail its requests (503), say which worker is
    stuck, kill the workers."""
    since = engine.stepping
    age = "" if since is None else f" after {time.monotonic() - since:.1f} s"
    why = (peers.unwell() if peers is not None else None) or \
        "no worker is gone or stopped: one is busy or deadlocked"
    engine.fail_all(503, "the server is shutting down")
    print(f"tpkit serve: a step did not return{age} ({why}); its requests got 503 and the "
          f"workers are killed", file=sys.stderr, flush=True)
    if peers is not None:
        peers.kill()


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
