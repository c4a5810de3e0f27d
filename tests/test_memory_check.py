"""Memory before it runs out, through `tpkit train`: the planner's estimate of every local
rank (weights, gradients, AdamW, activations) against what the machine offers is one
line before any process starts, naming the flags that would fit; --force runs anyway.
A rank the kernel kills near the limit is reported as probably out of memory, with its
peak RSS. (TPKIT_MEMORY_AVAILABLE caps what counts as available, as a shared machine
would; the kernel's OOM killer itself is not triggered here.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tpkit.cli import main
from tpkit.commands.memory_check import estimate
from tpkit.train.config import TrainConfig


def _train(capsys, monkeypatch, limit: int, *argv: str) -> tuple[int, str]:
    monkeypatch.setenv("TPKIT_MEMORY_AVAILABLE", str(limit))
    capsys.readouterr()
    status = main(["train", *argv])
    return status, capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_run_that_will_not_fit_is_one_line_naming_what_fits(tmp_path, capsys, monkeypatch):
    big = TrainConfig(preset="gpt2-124m", seq=512, global_batch=8, micro_batches=1)
    need, _ = estimate(big)
    lean, _ = estimate(big.with_(recompute=True))
    assert lean < need  # recompute keeps one tensor a layer instead of ~all of them
    argv = ["--preset", "gpt2-124m", "--seq", "512", "--global-batch", "8", "--steps", "1",
            "--out", str(tmp_path / "big")]
    status, err = _train(capsys, monkeypatch, int((need + lean) / 2), *argv)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("tpkit train: error: this run needs about ") and \
        "(1 process; the fullest rank" in lines[0] and "fits with: --recompute;" in lines[0] \
        and "is available (TPKIT_MEMORY_AVAILABLE)" in lines[0] and "--force" in lines[0], lines
    assert not (tmp_path / "big" / "checkpoints").exists()  # nothing started
    tiny = ["--steps", "1", "--seq", "32", "--no-progress", "--out", str(tmp_path / "tiny")]
    status, err = _train(capsys, monkeypatch, 1 << 20, *tiny)
    assert status == 2 and "none of --recompute" in err, err
    status, err = _train(capsys, monkeypatch, 1 << 20, *tiny, "--force")
    assert status == 0, err


def _die_like_an_oom_kill(rank: int) -> None:
    if rank == 1:
        time.sleep(2.5)  # the launcher reads its workers' peak RSS once a second
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_killed_near_the_limit_is_reported_as_out_of_memory(monkeypatch):
    from tpkit.launch import SpawnError, spawn

    monkeypatch.setenv("TPKIT_MEMORY_AVAILABLE", str(1 << 20))  # the machine is all but full
    with pytest.raises(SpawnError) as e:
        spawn(_die_like_an_oom_kill, 2, timeout=60)
    said = str(e.value)
    assert said.startswith("rank 1 died (signal 9: killed by the kernel, probably out of "
                           "memory (peak RSS "), said
    assert "on this rank" in said and "on all ranks; 0.0 GiB available now" in said, said
