"""Ctrl-C and SIGTERM through the real CLI, sent to the process group as a terminal
sends them (`os.killpg`):

- `tpkit train` (tp=2 x pp=2; FSDP over dp=2): the first signal finishes the step,
  saves a checkpoint there on every rank, exits 130 / 143 with one line naming the step
  and the command that continues it; that command (`--resume auto`) gives the losses of
  a run straight through, bit for bit.
- a second signal stops at once: one line, nothing saved, the same command.
- `tpkit quiz --live` and `tpkit verify`: exit 130, one line, no traceback from any
  process (their workers used to print ~45 lines of KeyboardInterrupt).
Nothing is left running or in /dev/shm.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proc_tree import cmdline, descendants, kill

SRC = str(Path(__file__).resolve().parents[1] / "src")
# a constant learning rate after warmup (min_lr = lr): --steps may change on resume
TRAIN = ["--preset", "gpt2-tiny", "--seq", "32", "--global-batch", "8", "--min-lr", "0.003",
         "--eval-every", "0", "--no-progress"]


def _start(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "tpkit", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)  # its own group, as in a shell


def _stop(proc: subprocess.Popen, sig: int, until, timeout: float = 300,
          again_after: float | None = None) -> tuple[str, str]:
    """Wait for `until()`, send `sig` to the process group (twice with `again_after`),
    return (stdout, stderr); every process of the group killed on the way out."""
    seen: list[int] = []
    try:
        t0 = time.monotonic()
        while not until():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() - t0 < timeout, "never got there"
            time.sleep(0.1)
        seen = descendants(proc.pid)
        os.killpg(proc.pid, sig)
        if again_after is not None:
            time.sleep(again_after)
            os.killpg(proc.pid, sig)
        return proc.communicate(timeout=timeout)
    finally:
        kill([*seen, *(descendants(proc.pid) if proc.poll() is None else [])])
        proc.kill()


def _steps_written(out: Path, n: int):
    metrics = out / "metrics.jsonl"
    return lambda: metrics.exists() and metrics.read_text().count("\n") >= n


def _started(pid: int, name: str, seconds: float):
    """A check: has a process below `pid` whose command line says `name` run `seconds`?"""
    seen: list[float] = []

    def ready() -> bool:
        if not seen and any(name in cmdline(p) for p in descendants(pid)):
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] >= seconds

    return ready


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _one_quiet_line(proc: subprocess.Popen, sig: int, stdout: str, stderr: str) -> str:
    assert proc.returncode == 128 + sig, stderr
    for text in (stdout, stderr):
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def _no_shared_memory_left(run_id: str) -> None:
    assert list(Path("/dev/shm").glob(f"tpkit-*-{run_id}*")) == []


def _here(argv: list[str], capsys) -> None:
    """`tpkit ARGV` through the CLI's entry in this process (`tpkit.cli.main`, what the
    installed `tpkit` runs): its ranks forked from this process's forkserver, torch
    imported once for the file, not once a run."""
    from tpkit.cli import main

    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err[-3000:]


def _stopped_then_resumed(tmp_path: Path, layout: list[str], sig: int, run_id: str,
                          monkeypatch, capsys) -> None:
    """Stop a 200-step run after 3 steps with `sig` (the real CLI in its own process
    group), continue it by the command its line gives, to 2 steps past the saved one; the
    same steps straight through: same losses. (Resumed and straight: in this process.)"""
    out = tmp_path / "stopped"
    env = {"TPKIT_RUN_ID": run_id}
    monkeypatch.setenv("TPKIT_RUN_ID", run_id)  # the segments of the runs in this process
    proc = _start(["train", *TRAIN, *layout, "--steps", "200", "--out", str(out)], env)
    line = _one_quiet_line(proc, sig, *_stop(proc, sig, _steps_written(out, 3)))
    name = signal.Signals(sig).name
    said = re.fullmatch(rf"tpkit train: stopped by {name}: saved step (\d+) in (\S+); "
                        rf"continue with: (tpkit train .*)", line)
    assert said, line
    step, ckpt, command = int(said[1]), Path(said[2]), shlex.split(said[3])
    assert ckpt == out / "checkpoints" / f"step_{step:06d}" and (ckpt / "manifest.json").exists()
    assert command[-2:] == ["--resume", "auto"] and command[2:-2] == \
        [*TRAIN, *layout, "--steps", "200", "--out", str(out)], command
    assert len(_losses(out)) == step  # the step finished, none after it
    steps = ["--steps", str(step + 2)]
    _here([*command[1:], *steps], capsys)
    straight = tmp_path / "straight"
    _here(["train", *TRAIN, *layout, *steps, "--out", str(straight)], capsys)
    assert _losses(out) == _losses(straight)  # exactly
    _no_shared_memory_left(run_id)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_saves_at_the_step_boundary_and_resume_continues_exactly(tmp_path, monkeypatch,
                                                                        capsys):
    """tp=2 x pp=2, SIGINT."""
    _stopped_then_resumed(tmp_path, ["--tp", "2", "--pp", "2", "--micro-batches", "2"],
                          signal.SIGINT, "stopsave1", monkeypatch, capsys)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_saves_an_fsdp_run_and_resume_continues_exactly(tmp_path, monkeypatch, capsys):
    """FSDP over dp=2, SIGTERM (a scheduler's preemption)."""
    _stopped_then_resumed(tmp_path, ["--dp", "2", "--fsdp"], signal.SIGTERM, "stopsave2",
                          monkeypatch, capsys)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    """Each checkpoint file written pauses 1 s (TPKIT_CKPT_PAUSE_S): the second SIGINT,
    0.3 s after the first, lands before the save completes."""
    from tpkit.weights.paths import newest_whole

    out = tmp_path / "run"
    proc = _start(["train", *TRAIN, "--tp", "2", "--steps", "200", "--out", str(out)],
                  {"TPKIT_CKPT_PAUSE_S": "1", "TPKIT_RUN_ID": "stopsave3"})
    line = _one_quiet_line(proc, signal.SIGINT, *_stop(proc, signal.SIGINT,
                                                       _steps_written(out, 2), again_after=0.3))
    assert re.fullmatch(r"tpkit train: stopped by SIGINT again, at once: nothing saved; no "
                        r"checkpoint yet; continue with: tpkit train .* --resume auto", line), line
    assert newest_whole(out / "checkpoints") is None
    _no_shared_memory_left("stopsave3")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv, ready", [
    (["quiz", "--live"], "Question 2/8"),  # a demonstration ran: its workers wait
    (["verify", "--component", "model", "--preset", "llama-tiny", "--tp", "1,2",
      "--seq", "128", "--batch", "16"], None),  # its forkserver is importing torch
])
def test_ctrl_c_ends_a_command_with_one_line(argv, ready, tmp_path):
    log = tmp_path / "stdout"
    proc = subprocess.Popen(  # stdout to a file, to watch it while the command runs
        [sys.executable, "-m", "tpkit", *argv], stdin=subprocess.PIPE, stdout=log.open("w"),
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", "")))
    proc.stdin.write("1\n")  # the quiz's first answer; the second it waits for
    proc.stdin.flush()
    _, err = _stop(proc, signal.SIGINT, (lambda: ready in log.read_text()) if ready else
                   _started(proc.pid, "forkserver", 0.5))
    line = _one_quiet_line(proc, signal.SIGINT, log.read_text(), err)
    assert line == f"tpkit {argv[0]}: stopped by SIGINT"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_under_torchrun_sigterm_to_the_agent_saves_on_every_rank(tmp_path):
    """A scheduler's SIGTERM to torchrun's agent, which forwards it to each rank: the ranks
    save at their step boundary, rank 0 alone says so, naming torchrun's own command.
    (torchrun then prints its own SignalException traceback: torch's, not tpkit's.)"""
    out = tmp_path / "run"
    agent = ["--nnodes", "1", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "127.0.0.1:0"]
    flags = ["train", *TRAIN, "--tp", "2", "--steps", "200", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *agent, "-m",
                             "tpkit", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    seen: list[int] = []
    try:
        ready = _steps_written(out, 3)
        while not ready():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        seen = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        kill([*seen, *(descendants(proc.pid) if proc.poll() is None else [])])
        proc.kill()
    ours = [line for line in err.splitlines() if line.startswith("tpkit train:")]
    assert len(ours) == 1, err
    said = re.fullmatch(r"tpkit train: stopped by SIGTERM: saved step (\d+) in (\S+); "
                        r"continue with: (.*)", ours[0])
    assert said and (Path(said[2]) / "manifest.json").exists(), ours
    assert shlex.split(said[3]) == ["torchrun", *agent, "-m", "tpkit", *flags, "--resume",
                                    "auto"]


def test_no_checkpoint_means_none_unless_an_interval_is_named():
    """`--no-checkpoint` alone writes no checkpoint, not even every --ckpt-every default
    steps (500); with another --ckpt-every, those are written (what old scripts meant);
    the default run checkpoints at 500 steps. (The step boundary's decision, one rank.)"""
    from tpkit.mesh import ParallelMesh
    from tpkit.train.config import TrainConfig
    from tpkit.train.loop import _Boundary

    def due(done: int, **kw) -> bool:
        cfg = TrainConfig(steps=10_000, ckpt_minutes=0, **kw)
        return _Boundary(cfg, ParallelMesh.single())(done, 0.01)[1]

    assert due(500) and not due(499)
    assert not due(500, checkpoint=False)
    assert due(5, checkpoint=False, ckpt_every=5) and not due(6, checkpoint=False, ckpt_every=5)
