"""Fault-tolerant training under torchrun: `--resume auto` with `--max-restarts 1`.

A damaged newest checkpoint is skipped for the previous one, with a warning; under
torchrun a flipped byte in one rank's shard too: rank 0 chooses for every rank. A worker
killed mid-run, torchrun restarting every worker and the run finishing with the losses
of an uninterrupted one: test_two_hosts.py (two torchrun agents on two simulated hosts,
one host lost whole and started again: the other agent restarts its own workers, the
path of a single agent whose worker died).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines() if r]
    return {r["step"]: r["loss"] for r in rows}


def test_resume_auto_skips_a_damaged_newest_checkpoint(tmp_path):
    from tpkit.checkpoint import latest, store
    from tpkit.mesh import ParallelMesh
    from tpkit.model import Transformer
    from tpkit.spec import get_preset

    model = Transformer(get_preset("gpt2-tiny"), ParallelMesh.single(), seed=0)
    for step in (2, 4):
        store.save(tmp_path / f"step_{step:06d}", model, step=step)
    shard = tmp_path / "step_000004" / "model-tp00-pp00.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert latest(tmp_path) == tmp_path / "step_000002"
    assert "step_000004: skipped, damaged" in str(said[0].message) and "truncated" in \
        str(said[0].message)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_under_torchrun_a_flipped_byte_in_one_ranks_shard_is_skipped_once(tmp_path, capsys):
    """Two bytes flipped in the newest checkpoint's tp rank 1 shard (sizes intact): rank 0
    chooses the checkpoint for every rank, so none reads the damaged one; one warning.
    (The checkpoints' run: the CLI's entry in this process, no interpreter to start.)"""
    from tpkit.cli import main

    out, env = tmp_path / "run", dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=SRC)
    tiny = ["--tp", "2", "--seq", "32", "--global-batch", "4", "--no-progress",
            "--ckpt-every", "1", "--out", str(out)]
    assert main(["train", *tiny, "--steps", "2"]) == 0, capsys.readouterr().err[-2000:]
    shard = out / "checkpoints" / "step_000002" / "model-tp01-pp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    data[len(data) // 2 + 3] ^= 1
    shard.write_bytes(bytes(data))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "tpkit",
           "train", *tiny, "--steps", "3", "--resume", "auto"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, [x for x in done.stderr.splitlines() if "rror" in x][:10]
    said = [x for x in done.stderr.splitlines() if "skipped, damaged" in x]
    assert len(said) == 1 and "step_000002: skipped, damaged (model-tp01-pp00.safetensors: " \
        "checksum mismatch" in said[0] and said[0].endswith("step_000001"), done.stderr[-2000:]
    assert list(_losses(out)) == [1, 2, 3]


def test_rank0_warns_when_a_restart_could_not_continue_the_run():
    from tpkit.host.elastic import SHARED_STORE, restart_advice

    two = {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert restart_advice(True, {**two, SHARED_STORE: "1"}) is None
    assert restart_advice(False, {"TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # no restarts
    lost = restart_advice(True, two)
    assert lost.startswith("warning: torchrun --max-restarts 3 over 2 hosts") and \
        f"{SHARED_STORE}=1" in lost and "--resume auto" not in lost
    alone = restart_advice(False, {"GROUP_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "1"})
    assert "--resume auto" in alone and SHARED_STORE not in alone


def test_a_dead_peer_is_named_with_its_host_when_ranks_span_hosts():
    import pickle

    from tpkit.comm.failure import CollectiveFailed

    e = CollectiveFailed("recv", "pp", (0, 1), 0, "pipeline", "backward", 0.0,
                         "Connection reset by peer", peer=1)
    assert "suspects: rank 1);" in e.after_step(7, ["a", "a"]).args[0]  # one host: no name
    e = pickle.loads(pickle.dumps(e.after_step(7, ["h0", "h1"])))
    assert "suspects: rank 1 on host h1); last step completed: 7" in str(e)
    cut = CollectiveFailed("all_reduce", "tp", (0, 1, 2, 3), 2, "layers.0", "forward", 3.0,
                           "Timed out waiting 3000ms").after_step(9, ["a", "a", "b", "b"])
    assert str(cut).endswith("timed out after 3.0 s (a peer is stuck or cut off; suspects: "
                             "rank 0 on host a, rank 1 on host a, rank 3 on host b); last "
                             "step completed: 9")  # a link that went down: no reset, a wait
