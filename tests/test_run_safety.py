"""Nothing lost when the world misbehaves, through the real `tpkit train`:

- two runs started together into one --out: exactly one runs, the other exits 2 in one
  line naming the holder's pid, and the folder holds one run (its steps once, its seed);
- a diverging run (--lr 1e4 --warmup 0) stops at the first NaN/inf step with one line
  naming the step and the quantity, exit 1, at tp=1 and tp=2; every checkpoint left is
  finite and `--resume auto` continues from it; `--on-nonfinite skip` skips and counts;
- storage: a full disk during a save is one line naming the file, the bytes and the free
  space, exit 1, no temporary left; --out read-only or a regular file: one line, exit 2,
  before spawning; a report file that cannot be written after the final checkpoint is a
  warning (exit 0); a leftover `.step_*.tmp` is removed at the next start.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["--steps", "2", "--seq", "32", "--global-batch", "4", "--no-progress"]


def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TPKIT_DEBUG", None)
    return {**env, **extra}


def _start(*argv: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tpkit", "train", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(**env))


def _here(capsys, *argv: str) -> subprocess.CompletedProcess:
    """`tpkit train ARGV` through `tpkit.cli.main` in this process: the console script's
    parser and error path without starting an interpreter (tp > 1 still spawns ranks)."""
    from tpkit.cli import main

    capsys.readouterr()
    status = main(["train", *argv])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, status, out, err)


def _one_error_line(r: subprocess.CompletedProcess, status: int) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == status, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("tpkit train: error: "), lines
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_runs_into_one_folder_one_runs_the_other_is_refused(tmp_path):
    """Two runs started at the same moment (seeds 0 and 7); the winner pauses after each
    checkpoint file, so it still holds the folder when the other arrives."""
    from tpkit.checkpoint import retention, store

    out = tmp_path / "run"
    procs = [_start(*TINY, "--seed", str(seed), "--out", str(out), TPKIT_CKPT_PAUSE_S="0.5")
             for seed in (0, 7)]
    try:
        done = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [d[1][-1500:] for d in done]
    won = 0 if procs[0].returncode == 0 else 1
    line = done[1 - won][1].strip().splitlines()
    assert len(line) == 1 and f"is in use by another run (pid {procs[won].pid} on host" \
        in line[0], line
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    (ckpt,) = retention.complete(out / "checkpoints")
    assert store.read_manifest(ckpt)["extra"]["config"]["seed"] == (0, 7)[won]
    assert (out / ".tpkit-run.lock").read_text() == ""  # released


def _finite_checkpoints(out: Path) -> list[int]:
    from safetensors.torch import load_file

    from tpkit.checkpoint import retention, store

    steps = []
    for d in retention.complete(out / "checkpoints"):
        for f in d.glob("*.safetensors"):
            assert all(torch.isfinite(t).all() for t in load_file(f).values()), f
        steps.append(store.read_manifest(d)["step"])
    return steps


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_diverging_run_stops_at_the_first_nonfinite_step(tmp_path, capsys):
    huge = [*TINY[2:], "--steps", "6", "--lr", "1e4", "--warmup", "0", "--ckpt-every", "1",
            "--keep-checkpoints", "1"]
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        line = _one_error_line(_here(capsys, *huge, "--tp", str(tp), "--out", str(out)), 1)
        assert "step 2: the gradient norm is nan" in line and "stopped before the update" \
            in line, line
        assert _finite_checkpoints(out) == [1]  # the last good one was kept, nothing NaN
    again = _one_error_line(_here(capsys, *huge, "--out", str(tmp_path / "tp1"), "--resume",
                                  "auto"), 1)
    assert "step 2: " in again  # resumed from step 1, the finite one, and stopped again
    line = _one_error_line(_here(capsys, *huge, "--lr", "1e39", "--out", str(out)), 2)
    assert "lr=1e+39 must be positive and below 1e30" in line, line  # not a torch overflow
    out = tmp_path / "skip"
    line = _one_error_line(_here(capsys, *huge, "--out", str(out), "--on-nonfinite", "skip",
                                  "--nonfinite-skips", "2"), 1)
    assert "step 3: 2 non-finite steps in a row" in line and "those of step 1" in line, line
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"]) for r in rows] == [(1, False), (2, True)]
    assert _finite_checkpoints(out) == [2]  # step 2 skipped its update: step 1's weights


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_storage_errors_are_one_line(tiny_mount, tmp_path, capsys):
    full = tiny_mount("1m") / "run"
    line = _one_error_line(_here(capsys, *TINY, "--tp", "2", "--out", str(full)), 1)
    assert "No space left on device while writing" in line and "free there:" in line, line
    assert "/checkpoints/.step_000002.tmp/" in line and " bytes" in line, line
    assert not [p for p in (full / "checkpoints").iterdir()], "a temporary was left behind"
    readonly = tiny_mount("1m", ro=True)
    line = _one_error_line(_here(capsys, *TINY, "--tp", "2", "--out", str(readonly / "run")), 2)
    assert "is not writable: Read-only file system" in line, line
    (tmp_path / "afile").write_text("x")
    line = _one_error_line(_here(capsys, *TINY, "--out", str(tmp_path / "afile")), 2)
    assert "is a regular file, not a folder" in line, line
    out = tmp_path / "report"
    (out / "loss.png").mkdir(parents=True)  # loss.png cannot be written
    (out / "checkpoints" / ".step_000001.tmp").mkdir(parents=True)  # an old killed save
    (out / "checkpoints" / ".step_000001.tmp" / "model-tp00-pp00.safetensors").write_text("x")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (out / ".tpkit-run.lock").write_text(json.dumps(dict(host="h", pid=int(dead), started=0)))
    r = _here(capsys, *TINY, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"taking over the lock of a run that ended without releasing it (pid {dead} on " \
        f"host h" in r.stderr
    assert "warning: loss.png not written" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002"]


def _raise(code: int, text: bool):
    """An OSError, or the text safetensors gives its I/O errors ('... (os error N)')."""
    if text:
        from safetensors import SafetensorError

        return SafetensorError(f"Error while serializing: IoError({os.strerror(code)} "
                               f"(os error {code}))")
    return OSError(code, os.strerror(code))


FAULTS = [("save_file", errno.ENOSPC, True), ("save_file", errno.EDQUOT, False),
          ("save_file", errno.EROFS, True), ("write_json", errno.ENOSPC, False),
          ("write_json", errno.EACCES, False), ("write_json", errno.EROFS, False)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target,code,text", FAULTS,
                         ids=[f"{t}-{errno.errorcode[c]}" for t, c, _ in FAULTS])
def test_a_failed_write_at_each_file_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch,
                                                                         target, code, text):
    """A full disk, a quota, a read-only file system or a refused permission injected
    into each kind of write of a save (the model and optimizer shards; a rank record,
    the manifest): one StorageError line naming the file, the bytes and the free space,
    exit 1 (the run failed, not the user), no temporary, the previous checkpoint kept."""
    from tpkit.checkpoint import manifest, store
    from tpkit.checkpoint.disk import StorageError
    from tpkit.cli import explain
    from tpkit.mesh import ParallelMesh
    from tpkit.model import Transformer
    from tpkit.spec import get_preset

    model = Transformer(get_preset("gpt2-tiny"), ParallelMesh.single(), seed=0)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW has state: the optimizer shard is written too
    store.save(tmp_path / "c", model, opt, step=1)
    real, calls = getattr(manifest, target), []  # the writes of a save happen there

    for fail_at in range(2):  # model + optimizer shards; rank record + manifest
        def failing(*args, _at=fail_at, **kw):
            calls.append(args[1] if target == "save_file" else args[0])
            if len(calls) - 1 == _at:
                raise _raise(code, text)
            return real(*args, **kw)

        calls.clear()
        monkeypatch.setattr(manifest, target, failing)
        with pytest.raises(StorageError, match=f"{os.strerror(code)} while writing") as e:
            store.save(tmp_path / "c", model, opt, step=2)
        assert Path(str(calls[fail_at])).name in str(e.value) and "free there" in str(e.value)
        assert explain(e.value) == (str(e.value), 1)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporary
        assert store.read_manifest(tmp_path / "c")["step"] == 1
    monkeypatch.setattr(manifest, target, real)


@pytest.mark.timeout(60)
def test_nonfinite_tensors_are_never_written_and_never_loaded(tmp_path):
    from tpkit.checkpoint import manifest, store
    from tpkit.mesh import ParallelMesh
    from tpkit.model import Transformer
    from tpkit.spec import get_preset
    from tpkit.weights.finite import NonFiniteCheckpoint

    model = Transformer(get_preset("gpt2-tiny"), ParallelMesh.single(), seed=0)
    store.save(tmp_path / "c", model, step=1)
    name, p = next(iter(model.named_parameters()))
    with torch.no_grad():
        p[0, 0] = float("nan")
    with pytest.raises(NonFiniteCheckpoint, match=rf"not written: {name} holds 1 non-finite"):
        store.save(tmp_path / "c", model, step=2)
    assert store.read_manifest(tmp_path / "c")["step"] == 1
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c"]
    real = manifest.first_nonfinite  # the check of a save's writes
    manifest.first_nonfinite = lambda tensors: None  # as an older tpkit would have written it
    try:
        store.save(tmp_path / "nan", model, step=2)
    finally:
        manifest.first_nonfinite = real
    with pytest.raises(store.CheckpointError, match=rf"{name} holds 1 non-finite.*diverged"):
        store.load(tmp_path / "nan", model)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rank_killed_in_the_final_save_reports_every_step_completed(tmp_path):
    from proc_tree import kill, workers

    out = tmp_path / "run"
    proc = _start(*TINY, "--steps", "3", "--tp", "2", "--out", str(out),
                  "--collective-timeout", "10", TPKIT_CKPT_PAUSE_S="0.5")
    try:  # rank 1 wrote its last file of the final save and pauses before the others'
        last = out / "checkpoints" / ".step_000003.tmp" / "rank-00001.json"
        while not last.exists():  # polled, not spun: a spinning loop took a core from
            assert proc.poll() is None, proc.communicate()[1][-2000:]  # the ranks
            time.sleep(0.01)  # (the pause: 0.5 s)
        kill([workers(proc.pid)[1]])
        err = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "rank 1 died (signal 9)" in lines[0] and "last step completed: 3" in lines[0], lines
