"""benchmarks/gpu_check.py runs its whole path on the CPU with tiny models (`--tiny
--cpu`): the exactness section, then training in each variant (eager, chunked loss,
compiled blocks, fp32 master weights), every row written to the JSON. The GPU run is
the same code with bigger presets (docs/benchmarks.md gives the command)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_gpu_check_cpu_path_writes_every_variant(tmp_path):
    variants = ["eager", "chunked", "compile+chunked+master"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny", "--cpu",
           "--steps", "3", "--models", "gpt2-tiny", "--variants", ",".join(variants),
           "--compile-backend", "aot_eager", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=160)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["preset"] for r in report["exactness"]] == ["gpt2-tiny", "llama-tiny", "bert-tiny"]
    assert all(r["logits_diff"] == 0.0 for r in report["exactness"])  # cpu against cpu
    rows = report["throughput"]
    assert [r["variant"] for r in rows] == variants
    for r in rows:
        assert r["step_s"] > 0 and r["mfu"] is None and math.isfinite(r["last_loss"])
    assert rows[0]["first_loss"] == pytest.approx(rows[1]["first_loss"], abs=1e-3)
    assert "compile+chunked+master" in done.stdout
