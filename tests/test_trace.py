"""`tpkit train --trace`: the last step's timeline, per rank, from the ledger's own
timestamps. The merged trace is valid Chrome-trace JSON in which every rank shows
compute, its blocking tp collectives (with their scopes), the dX all-reduce in flight
with the dW matmul under it, and, by layout, pipeline sends/receives and the bubble
(tp=2 x pp=2) or the data-parallel gradient buckets (tp=2 x dp=2); and a PNG of it."""

from __future__ import annotations

import json

import pytest

from tpkit.train.config import TrainConfig
from tpkit.train.loop import train
from tpkit.train.trace import merge


def traced(mesh, folder: str) -> bool:
    cfg = TrainConfig(preset="gpt2-tiny", tp=mesh.tp_size, pp=mesh.pp_size, dp=mesh.dp_size,
                      steps=2, micro_batches=2, global_batch=8, seq=32, val_fraction=0.0,
                      trace=folder + "/trace", out=folder, progress=False, plot=False,
                      checkpoint=False)
    return train(cfg, mesh).theory_ok


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("pp,dp,kinds", [
    (2, 1, {"compute", "tp", "tp async", "overlap", "pp", "bubble"}),
    (1, 2, {"compute", "tp", "tp async", "overlap", "dp"})])
def test_trace_shows_each_kind_of_work_on_every_rank(run_tp, tmp_path, pp, dp, kinds):
    assert all(run_tp(traced, 2, str(tmp_path), pp=pp, dp=dp))
    (tmp_path / "trace" / "rank7.json").write_text("{}")  # a stale part of a bigger run
    path = merge(tmp_path / "trace", 4, "test", png_copy=tmp_path / "trace.png")
    events = json.loads(path.read_text())["traceEvents"]  # valid JSON
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    for rank in range(4):
        mine = [e for e in spans if e["pid"] == rank]
        assert kinds <= {e["cat"] for e in mine}, (rank, {e["cat"] for e in mine})
        tp_scopes = {e["name"].split()[1] for e in mine if e["cat"] == "tp"
                     and e["name"].startswith("all_reduce")}
        assert any(s.startswith("layers.") for s in tp_scopes), tp_scopes
        named = {e["args"].get("name", "") for e in events if e["ph"] == "M" and e["pid"] == rank}
        assert f"rank {rank} (pp {rank // 2 if pp > 1 else 0}" in " ".join(named)
    for png in (tmp_path / "trace" / "step.png", tmp_path / "trace.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_merge_with_missing_parts_is_one_clear_error(tmp_path):
    (tmp_path / "rank0.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"lacks the trace parts \['rank1.json'\] of 2"):
        merge(tmp_path, 2)
