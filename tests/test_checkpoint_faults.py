"""Damaged checkpoints fail loudly and change nothing; a killed save keeps the old one;
`tpkit convert` round-trips and reshards offline.

Checked: a flipped byte, a truncated file, a missing shard, a manifest of another
model each raise a CheckpointError naming the file and the problem, and every
parameter of the model (on every rank) is unchanged afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint_helpers import LLAMA, fill, gather, local_state, random_full, set_grads
from tpkit.checkpoint import convert, retention
from tpkit.checkpoint import store as ckpt
from tpkit.checkpoint.manifest import PAUSE_ENV
from tpkit.cli import command_parser
from tpkit.commands import convert as convert_cmd
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer


def saved(path: Path, seed: int = 1) -> tuple[Transformer, dict]:
    mesh = ParallelMesh.single()
    model = Transformer(LLAMA, mesh)
    fill(model, random_full(LLAMA, seed=seed), mesh)
    ckpt.save(path, model, step=seed, mesh=mesh)
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))


def truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:-100])


def other_model(root: Path) -> None:
    import json

    m = json.loads((root / "manifest.json").read_text())
    m["config"]["num_layers"] = 6
    (root / "manifest.json").write_text(json.dumps(m))


FAULTS = [("flipped byte", lambda r: flip(r / "model-tp00-pp00.safetensors"),
           "model-tp00-pp00.safetensors: checksum mismatch"),
          ("truncated", lambda r: truncate(r / "model-tp00-pp00.safetensors"),
           "model-tp00-pp00.safetensors: truncated"),
          ("missing shard", lambda r: (r / "model-tp00-pp00.safetensors").unlink(),
           "model-tp00-pp00.safetensors: missing shard"),
          ("other model", other_model, r"manifest.json: written for a different model: "
                                       r"num_layers=6 in the checkpoint, 4 in the model"),
          ("no manifest", lambda r: (r / "manifest.json").unlink(), "manifest.json: missing")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault,damage,message", FAULTS, ids=[f[0] for f in FAULTS])
def test_damaged_checkpoint_is_refused(tmp_path, fault, damage, message):
    saved(tmp_path / "c", seed=1)
    model, before = saved(tmp_path / "other", seed=2)
    damage(tmp_path / "c")
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load(tmp_path / "c", model)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed by a failed load"


def damaged_load_worker(mesh, path):
    model = Transformer(LLAMA, mesh, seed=9)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        ckpt.load(path, model, mesh=mesh)
    except ckpt.CheckpointError as e:
        unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        return str(e), unchanged
    return None, False


@pytest.mark.timeout(60)
def test_one_rank_damaged_no_rank_loads(run_tp, tmp_path):
    saved(tmp_path / "c")
    convert.reshard(tmp_path / "c", tmp_path / "tp2", tp=2)
    flip(tmp_path / "tp2" / "model-tp01-pp00.safetensors")  # only rank 1 reads it
    (err0, same0), (err1, same1) = run_tp(damaged_load_worker, 2, str(tmp_path / "tp2"))
    assert "model-tp01-pp00.safetensors: checksum mismatch" in err1
    assert "another rank failed to load" in err0
    assert same0 and same1


KILLED_SAVE = """
import sys, torch
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.checkpoint import store as ckpt
sys.path.insert(0, sys.argv[2])
from checkpoint_helpers import LLAMA
model = Transformer(LLAMA, ParallelMesh.single(), seed=3)
opt = torch.optim.AdamW(model.parameters())
ckpt.save(sys.argv[1], model, opt, step=99)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_save_keeps_previous(tmp_path):
    root = tmp_path / "ckpt"
    model, before = saved(root, seed=1)
    env = dict(os.environ, **{PAUSE_ENV: "30"})
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(root),
                             str(Path(__file__).parent)], env=env)
    tmp = tmp_path / ".ckpt.tmp"
    deadline = time.monotonic() + 240  # importing torch on a loaded machine
    while not (tmp / "model-tp00-pp00.safetensors").exists():  # mid-save: first file written
        assert proc.poll() is None and time.monotonic() < deadline, "save did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert ckpt.load(root, model)["step"] == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    ckpt.save(root, model, step=2)  # the next save cleans the leftover
    assert not tmp.exists() and ckpt.read_manifest(root)["step"] == 2


def train_save(mesh, path):
    model = Transformer(LLAMA, mesh)
    fill(model, random_full(LLAMA, seed=1), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    set_grads(model, random_full(LLAMA, seed=2), mesh)
    opt.step()
    ckpt.save(path, model, opt, step=5, mesh=mesh)
    return local_state(model, mesh, opt)


def plain_load(mesh, path, with_optimizer=True):
    model = Transformer(LLAMA, mesh, seed=3)
    opt = torch.optim.AdamW(model.parameters()) if with_optimizer else None
    ckpt.load(path, model, opt, mesh=mesh)
    return local_state(model, mesh, opt)


@pytest.mark.timeout(90)
def test_convert_full_and_offline_reshard(run_tp, tmp_path):
    want = run_tp(train_save, 2, str(tmp_path / "c22"), pp=2)
    full = convert.to_full(tmp_path / "c22", tmp_path / "full.safetensors")
    args = command_parser("convert").parse_args(  # as `tpkit convert` reads its line
        [str(tmp_path / "c22"), str(tmp_path / "c41"), "--to", "sharded", "--tp", "4"])
    assert convert_cmd.run(args) == 0  # keeps the optimizer state
    convert.reshard(full, tmp_path / "f12", tp=1, pp=2)  # weights only
    v = LLAMA.vocab_size
    for path, tp, pp in (("c41", 4, 1), ("f12", 1, 2)):
        got = run_tp(plain_load, tp, str(tmp_path / path), path == "c41", pp=pp)
        for n, t in gather(want, v).items():
            assert torch.equal(gather(got, v)[n], t), (path, n)
    got = gather(run_tp(plain_load, 4, str(tmp_path / "c41")), v, "opt")
    assert got.keys() == gather(want, v, "opt").keys()
    for n, t in gather(want, v, "opt").items():
        assert torch.equal(got[n], t), n
    bad = command_parser("convert").parse_args(
        [str(tmp_path / "nowhere"), str(tmp_path / "x"), "--to", "full"])
    with pytest.raises(ckpt.CheckpointError, match="nowhere"):  # one line, from tpkit.cli
        convert_cmd.run(bad)


def raising_load_worker(mesh, path):
    ckpt.load(path, Transformer(LLAMA, mesh, seed=9), mesh=mesh)


@pytest.mark.timeout(120)
def test_the_launcher_shows_the_failing_ranks_own_error(run_tp, tmp_path):
    """Rank 0 fails only because rank 1 did ("another rank failed to load"): the error
    that reaches the user is rank 1's, naming its file."""
    from tpkit.cli import explain
    from tpkit.launch import SpawnError

    saved(tmp_path / "c")
    convert.reshard(tmp_path / "c", tmp_path / "tp2", tp=2)
    flip(tmp_path / "tp2" / "model-tp01-pp00.safetensors")  # only rank 1 reads it
    with pytest.raises(SpawnError) as info:
        run_tp(raising_load_worker, 2, str(tmp_path / "tp2"))
    assert info.value.rank == 1
    line, status = explain(info.value)
    assert status == 2 and line.startswith("rank 1: ") and \
        "model-tp01-pp00.safetensors: checksum mismatch" in line, line


@pytest.mark.timeout(60)
def test_a_damaged_full_file_is_refused_naming_it(tmp_path):
    """One flipped bit in a full .safetensors file's tensor data (today: loads and
    generates, exit 0) fails its sha256; a truncated file is named, not a raw error."""
    saved(tmp_path / "c")
    full = convert.to_full(tmp_path / "c", tmp_path / "full.safetensors")
    assert convert.open_source(full).config == LLAMA
    data = bytearray(full.read_bytes())
    data[-10] ^= 0x40  # inside the last tensor's bytes
    (tmp_path / "flipped.safetensors").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"flipped.safetensors: checksum mismatch"):
        convert.open_source(tmp_path / "flipped.safetensors")
    truncate(full)
    with pytest.raises(ckpt.CheckpointError, match=r"full.safetensors: not a readable"):
        convert.open_source(full)


@pytest.mark.timeout(60)
def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in range(1, 6):
        saved(tmp_path / f"step_{step:06d}", seed=step)
    (tmp_path / ".step_000009.tmp").mkdir()  # a save killed midway: not a checkpoint
    gone = retention.prune(tmp_path, keep=2)
    assert [d.name for d in gone] == [f"step_{s:06d}" for s in (1, 2, 3)]
    assert [read["step"] for read in map(ckpt.read_manifest, retention.complete(tmp_path))] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_000009.tmp", "step_000004",
                                                          "step_000005"]
    assert retention.prune(tmp_path, keep=0) == [] and len(retention.complete(tmp_path)) == 2


SAVE_FOREVER = """
import os, sys
from tpkit.checkpoint import retention
from tpkit.checkpoint import store as ckpt
from tpkit.weights.paths import step_dir
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
sys.path.insert(0, sys.argv[2])
from checkpoint_helpers import LLAMA
run = sys.argv[1]
for line in sys.stdin:  # one saver per line, forked from this process (torch imported once)
    pid = os.fork()
    if pid == 0:
        try:
            step = int(line)
            while True:  # what training does at every --ckpt-every: save, drop the oldest
                step += 1
                path = step_dir(run, step)
                ckpt.save(path, Transformer(LLAMA, ParallelMesh.single(), seed=step), step=step)
                retention.prune(path.parent, keep=2)
        finally:
            os._exit(1)  # a saver that fails never runs this loop
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("gone", flush=True)
"""


def _newest_step(run: Path) -> int:
    """The step of the newest valid checkpoint (-1: none yet), read while saves and prunes
    go on: the one found may be pruned before its manifest is read (then look again)."""
    from tpkit.weights.paths import latest

    while True:
        found = latest(run)
        if found is None:
            return -1
        try:
            return ckpt.read_manifest(found)["step"]
        except ckpt.CheckpointError:
            if found.exists():
                raise


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_at_random_moments_of_saving_never_loses_the_latest_valid(tmp_path):
    """kill -9 at 12 random moments of a save-and-prune loop (mid-write, mid-manifest,
    mid-prune): each time the newest valid checkpoint loads with exactly its step's
    weights, no step goes backwards, and every complete checkpoint left verifies. Each
    saver is forked from one process that imported torch once, then killed."""
    import random

    from tpkit.weights.paths import latest

    run, rng, newest = tmp_path / "run", random.Random(0), 0
    forks = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, str(run),
                              str(Path(__file__).parent)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(12):
            forks.stdin.write(f"{newest}\n")
            forks.stdin.flush()
            saver = int(forks.stdout.readline())
            deadline = time.monotonic() + 240
            while _newest_step(run) <= newest:
                assert forks.poll() is None and time.monotonic() < deadline, "no save completed"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.3))  # somewhere in the next saves and prunes
            os.kill(saver, signal.SIGKILL)
            assert forks.stdout.readline() == "gone\n"
            found = latest(run)
            step = ckpt.read_manifest(found)["step"]
            assert step > newest, (step, newest)
            model = Transformer(LLAMA, ParallelMesh.single(), seed=0)
            assert ckpt.load(found, model)["step"] == step
            want = dict(Transformer(LLAMA, ParallelMesh.single(), seed=step).named_parameters())
            assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
            for d in retention.complete(run / "checkpoints"):  # nothing whole-looking is damaged
                for name, entry in ckpt.read_manifest(d)["files"].items():
                    ckpt.verify_file(d, name, entry)
            newest = step
    finally:
        forks.kill()
        forks.wait()
