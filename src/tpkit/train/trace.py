"""`tpkit train --trace DIR`: a per-rank timeline of the last step, from the ledger's own
timestamps, as a Chrome / Perfetto trace (open DIR/trace.json in ui.perfetto.dev or
chrome://tracing) and a PNG (DIR/step.png, copied into the run folder).

One process per rank, four tracks each:

    main       compute | tp collective (blocking) | bubble (waiting on a pipeline recv)
               | dW matmul (while the dX all-reduce is in flight) | wait for it
    tp async   the dX all-reduce (or reduce-scatter) of a column-parallel layer's
               backward, from post to completion: it overlaps the dW matmul above
    pp         pipeline sends and receives (activations forward, gradients backward),
               and the ring attention's k/v hops over the cp group
    dp         gradient buckets all-reduced over data-parallel replicas; ZeRO-2 and FSDP
               gathers and reduce-scatters (FSDP prefetches the next layer's gather: it
               is drawn from its post, overlapping the current layer's compute)

Collectives carry their ledger scope (layers.3.mlp, head, loss, pipeline) and phase;
compute is what the main thread did between them, named after the collective it led to.
An asynchronous collective is drawn from its post to the return of its wait; the time it
cost this rank (`seconds`) as the wait at its end, the rest as overlapped compute.
"""

from __future__ import annotations

import json
from pathlib import Path

from tpkit.comm.ledger import Record
from tpkit.train.trace_plot import plot_step

TRACKS = {"main": 0, "tp async": 1, "pp": 2, "dp": 3}
KINDS = ("compute", "tp", "tp async", "overlap", "bubble", "pp", "dp", "other")


def _event(name: str, cat: str, a: float, b: float, rank: int, track: str, **args) -> dict:
    return dict(name=name, cat=cat, ph="X", ts=round(a * 1e6, 3), dur=round(max(b - a, 0) * 1e6, 3),
                pid=rank, tid=TRACKS[track], args=args)


def _record_events(r: Record, rank: int) -> list[dict]:
    """The events of one collective: where it blocked, and where it was in flight."""
    label, args = f"{r.op} {r.scope} ({r.phase})", dict(numel=r.numel, bytes=r.nbytes,
                                                         group=r.group)
    hidden = (r.end - r.start) - r.seconds  # > 0: asynchronous, overlapped with compute
    wait_from = r.end - r.seconds
    if r.group == "pp":
        cat = "bubble" if r.op == "recv" else "pp"
        return [_event(label, "pp", r.start, r.end, rank, "pp", **args),
                _event(f"{cat}: {label}", cat, r.start, r.end, rank, "main", **args)]
    if r.group == "cp":
        return [_event(f"cp ring {r.op} ({r.phase})", "pp", r.start, r.end, rank, "pp", **args)]
    if r.group in ("dp", "dp_cp"):  # the gradients' group (dp x cp ranks with cp > 1)
        what = f"{r.scope} {r.op} ({r.phase})" if r.scope in ("fsdp", "zero2") else \
            f"dp bucket {r.op}"
        return [_event(what, "dp", r.start, r.end, rank, "dp", **args),
                _event(f"wait {what} ({r.numel:,})", "dp", wait_from, r.end, rank, "main")]
    if r.group == "tp" and hidden > 0:
        return [_event(f"dX {label}", "tp async", r.start, r.end, rank, "tp async", **args),
                _event(f"dW matmul {r.scope} (dX {r.op} in flight)", "overlap", r.start,
                       wait_from, rank, "main"),
                _event(f"wait dX {r.op} {r.scope}", "tp", wait_from, r.end, rank, "main", **args)]
    return [_event(label, "tp" if r.group == "tp" else "other", r.start, r.end, rank, "main",
                   **args)]


def step_events(records: list[Record], t0: float, t1: float, rank: int) -> list[dict]:
    """Trace events of one step [t0, t1] (perf_counter seconds) of this rank."""
    events = [e for r in records if t0 <= r.start <= t1 for e in _record_events(r, rank)]
    main = sorted((e for e in events if e["tid"] == TRACKS["main"]), key=lambda e: e["ts"])
    gaps, at = [], t0 * 1e6
    for e in main + [dict(ts=t1 * 1e6, dur=0.0, name="end of step")]:
        if e["ts"] > at:  # the main thread computed until this collective
            gaps.append(dict(name=f"compute -> {e['name']}", cat="compute", ph="X",
                             ts=round(at, 3), dur=round(e["ts"] - at, 3), pid=rank,
                             tid=TRACKS["main"], args={}))
        at = max(at, e["ts"] + e["dur"])
    return gaps + events


def _names(rank: int, title: str) -> list[dict]:
    meta = [dict(name="process_name", ph="M", pid=rank, args=dict(name=title)),
            dict(name="process_sort_index", ph="M", pid=rank, args=dict(sort_index=rank))]
    return meta + [dict(name="thread_name", ph="M", pid=rank, tid=t, args=dict(name=n))
                   for n, t in TRACKS.items()]


def write_rank(folder: str | Path, rank: int, title: str, events: list[dict]) -> Path:
    """This rank's part: `folder/rank<r>.json` (merged by `merge`)."""
    path = Path(folder) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(traceEvents=_names(rank, title) + events)))
    tmp.replace(path)
    return path


def merge(folder: str | Path, ranks: int, title: str = "",
          png_copy: str | Path | None = None) -> Path:
    """Ranks 0..ranks-1's parts -> `folder/trace.json` (times from the first event) and
    `folder/step.png` (also copied to `png_copy`); returns the trace's path."""
    folder = Path(folder)
    parts = [folder / f"rank{r}.json" for r in range(ranks)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks the trace parts {missing} of {ranks} ranks")
    events = [e for p in parts for e in json.loads(p.read_text())["traceEvents"]]
    timed = [e for e in events if e["ph"] == "X"]
    origin = min(e["ts"] for e in timed)  # perf_counter is one clock for a node's processes
    for e in timed:
        e["ts"] = round(e["ts"] - origin, 3)
    out = folder / "trace.json"
    out.write_text(json.dumps(dict(traceEvents=events, displayTimeUnit="ms")))

    png = plot_step(events, folder / "step.png", title)
    if png_copy is not None:
        Path(png_copy).write_bytes(png.read_bytes())
    return out
