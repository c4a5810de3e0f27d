"""Clean shutdown and dead ranks, through the real `tpkit train` (tp=2 x pp=2, 4 processes,
for a dead rank; tp=2, 2 processes, for a signal to the launcher).

- SIGTERM, SIGHUP, SIGINT to the launcher only: it kills and waits for its workers (after
  they saved at their step boundary, for SIGTERM and SIGINT) and exits with 128 + the
  signal, its line saying how to continue; SIGKILL to the launcher: each worker notices its lifeline
  pipe close and kills itself. Either way no descendant (workers, forkserver, resource
  tracker) is left after 10 s, and the newest complete checkpoint still verifies.
- A rank killed (SIGKILL) or stopped (SIGSTOP) mid-run: the run stops within the
  collective timeout with one line naming that rank, what the others were waiting in
  (collective, group, scope), the last step completed and the command that continues.
Either way nothing of the run is left in /dev/shm (its groups talk through shared memory).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proc_tree import descendants, kill, wait_gone, workers

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _start_train(out: Path, *extra: str, pp: int = 2) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TPKIT_RUN_ID=_run_prefix(out))
    cmd = [sys.executable, "-m", "tpkit", "train", "--preset", "gpt2-tiny", "--tp", "2",
           "--pp", str(pp), "--steps", "100000", "--seq", "32", "--global-batch", "8",
           "--micro-batches", "2", "--out", str(out), "--no-progress", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _run_prefix(out: Path) -> str:
    """The start of the run id of this test's launcher (in its shared-memory names)."""
    return "shut" + str(abs(hash(str(out))) % 10**6)


def _no_shared_memory_left(out: Path) -> None:
    left = [p.name for p in Path("/dev/shm").glob(f"tpkit-*-{_run_prefix(out)}*")]
    assert left == [], left


def _wait_steps(proc: subprocess.Popen, out: Path, steps: int, timeout: float = 400) -> None:
    t0, metrics = time.monotonic(), out / "metrics.jsonl"
    while time.monotonic() - t0 < timeout:
        if metrics.exists() and metrics.read_text().count("\n") >= steps:
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps in {timeout} s")


def _kill_all(proc: subprocess.Popen, seen: list[int]) -> None:
    """After a failure too: SIGKILL the launcher's processes seen earlier and, while it
    runs, those below it now (once it is reaped its pid may be another process's)."""
    kill([*seen, *(descendants(proc.pid) if proc.poll() is None else [])])
    proc.kill()


def _newest_checkpoint_verifies(out: Path) -> None:
    from tpkit.checkpoint import latest, store
    from tpkit.weights.files import verify_file

    newest = latest(out / "checkpoints")
    assert newest is not None
    manifest = store.read_manifest(newest)
    for name, entry in manifest["files"].items():
        verify_file(newest, name, entry)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT", "SIGKILL"])
def test_a_signal_to_the_launcher_leaves_no_process(sig, tmp_path):
    proc, below = _start_train(tmp_path, "--ckpt-every", "2", pp=1), []
    try:
        _wait_steps(proc, tmp_path, 3)
        below = descendants(proc.pid)
        assert len(workers(proc.pid)) == 2 and len(below) >= 3, below
        os.kill(proc.pid, getattr(signal, sig))
        _, left = wait_gone([proc.pid, *below], timeout=10)
        assert left == [], f"{sig}: still running after 10 s: {left}"
        err = proc.communicate(timeout=30)[1]
    finally:
        _kill_all(proc, below)
    signum = getattr(signal, sig)
    assert proc.returncode == (-signum if sig == "SIGKILL" else 128 + signum), err
    if sig != "SIGKILL":  # SIGTERM and SIGINT save at the step boundary first; SIGHUP not
        line = err.strip().splitlines()[-1]
        saved = ": saved step " if sig != "SIGHUP" else "; newest checkpoint: "
        assert line.startswith(f"tpkit train: stopped by {sig}{saved}"), err
        assert line.endswith(" --resume auto") and "; continue with: tpkit train " in line, err
        assert "leaked semaphore" not in err and "Traceback" not in err, err
    _newest_checkpoint_verifies(tmp_path)
    _no_shared_memory_left(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig, says", [("SIGKILL", "rank 1 died (signal 9)"),
                                       ("SIGSTOP", "rank 1 stopped making progress")])
def test_a_dead_or_stuck_rank_stops_the_run_with_one_line(sig, says, tmp_path):
    proc = _start_train(tmp_path, "--collective-timeout", "5")
    try:
        _wait_steps(proc, tmp_path, 3)
        os.kill(workers(proc.pid)[1], getattr(signal, sig))
        err = proc.communicate(timeout=120)[1]
    finally:
        _kill_all(proc, [])
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith("tpkit train: error: ") and says in line, line
    # Where the kill lands decides what the others were waiting in when they gave up (a tp
    # all-reduce in a layer, a pp send or receive, the grad-norm all-reduce over all model
    # ranks; a rank waiting on another waiting rank). Whichever it is, the line names its
    # op, group and ranks, scope and phase, after naming rank 1 as the cause.
    assert line.index(says) < line.index(" then rank "), line
    assert re.search(r"then rank \d: \w+ over \w+ \[[\d, ]+\] \(scope [^,]+, \w+\)", line), line
    assert "last step completed: " in line and "none" not in line.split("completed: ")[1]
    assert line.endswith("; no checkpoint yet; continue with: tpkit train --preset gpt2-tiny "
                         f"--tp 2 --pp 2 --steps 100000 --seq 32 --global-batch 8 "
                         f"--micro-batches 2 --out {tmp_path} --no-progress "
                         f"--collective-timeout 5 --resume auto"), line
    _no_shared_memory_left(tmp_path)
