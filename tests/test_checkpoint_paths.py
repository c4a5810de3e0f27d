"""Every kind of path opens the same way, in the library and in every command.

Checked: `load_model` on a sharded checkpoint, a run folder (its latest valid
checkpoint), a full .safetensors file and a Hugging Face directory gives, at tp=1 and
tp=2, exactly the weights that were saved; a run folder whose newest checkpoint is
damaged (truncated shard, missing manifest) gives the previous one with a warning
naming the skipped one; a path that is none of these is one CheckpointError line
naming it. Then the same run folder through `tpkit generate`, `convert`, `verify` and
`train --resume`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_helpers import LLAMA, fill, gather, local_state, random_full
from helpers import generate_args
from tpkit.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    latest,
    load_model,
    locate,
    open_source,
)
from tpkit.checkpoint import store as ckpt
from tpkit.checkpoint.convert import to_full, to_hf
from tpkit.cli import main
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.weights.paths import FULL, HF, SHARDED, sharded_dir, step_dir

STEPS = (2, 4)  # checkpoints of the run folder; the weights of step s are random_full(seed=s)


def _save(path: Path, step: int) -> None:
    mesh = ParallelMesh.single()
    model = Transformer(LLAMA, mesh)
    fill(model, random_full(LLAMA, seed=step), mesh)
    ckpt.save(path, model, step=step, mesh=mesh)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    """kind -> a path of that kind holding the weights of step 4."""
    root = tmp_path_factory.mktemp("paths")
    for s in STEPS:
        _save(step_dir(root / "run", s), s)
    newest = step_dir(root / "run", 4)
    return dict(sharded=newest, run=root / "run",
                full=to_full(newest, root / "model.safetensors"),
                hf=to_hf(newest, root / "hf"))


def _damaged_run(paths, tmp_path: Path, damage) -> Path:
    run = tmp_path / "run"
    shutil.copytree(paths["run"], run)
    damage(step_dir(run, 4))
    return run


def weights_worker(mesh, path):
    return local_state(load_model(path, mesh), mesh)


def _assert_weights_of(results: list[dict], step: int) -> None:
    got, want = gather(results, LLAMA.vocab_size), random_full(LLAMA, seed=step)
    assert got.keys() == want.keys()
    for n, t in want.items():
        assert torch.equal(got[n], t), n


def test_locate_each_kind(paths):
    newest = paths["sharded"]
    assert locate(newest) == locate(paths["run"]) == locate(paths["run"] / "checkpoints")
    assert locate(paths["run"]).kind == SHARDED and locate(paths["run"]).path == newest
    assert locate(paths["full"]).kind == FULL and locate(paths["hf"]).kind == HF
    for kind in ("sharded", "run", "full", "hf"):
        source = open_source(paths[kind])
        assert source.config.hidden == LLAMA.hidden, kind
        assert "layers.3.mlp.fc2.weight" in source.names, kind


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["sharded", "run", "full", "hf"])
def test_load_model_every_kind_at_tp1_and_tp2(run_tp, paths, kind):
    _assert_weights_of([weights_worker(ParallelMesh.single(), paths[kind])], 4)
    _assert_weights_of(run_tp(weights_worker, 2, str(paths[kind])), 4)


def truncate(d: Path) -> None:
    f = d / "model-tp00-pp00.safetensors"
    f.write_bytes(f.read_bytes()[:-64])


def no_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


@pytest.mark.parametrize("damage,why", [(truncate, "truncated"), (no_manifest, "missing")])
def test_run_folder_with_damaged_newest_loads_the_previous(paths, tmp_path, damage, why):
    run = _damaged_run(paths, tmp_path, damage)
    with pytest.warns(CheckpointWarning, match=f"step_000004: skipped, damaged .*{why}"):
        model = load_model(run, ParallelMesh.single())
    _assert_weights_of([local_state(model, ParallelMesh.single())], 2)
    with pytest.warns(CheckpointWarning):
        assert latest(run) == step_dir(run, 2)
    damage(step_dir(run, 2))
    with pytest.raises(CheckpointError, match="no valid checkpoint in this run folder"):
        locate(run)


def flip_two_bytes(d: Path) -> None:
    f = d / "model-tp00-pp00.safetensors"
    data = bytearray(f.read_bytes())
    for i in (len(data) // 2, len(data) // 2 + 1):
        data[i] ^= 0x10
    f.write_bytes(bytes(data))


def hashing_worker(mesh, source):
    """The files this rank hashed while loading `source` (opened by the parent)."""
    from tpkit.weights import files

    real, hashed = files.file_entry, []
    files.file_entry = lambda path: hashed.append(path.name) or real(path)
    try:
        local_state(load_model(source, mesh), mesh)
    finally:
        files.file_entry = real
    return hashed


@pytest.mark.timeout(120)
def test_a_flipped_byte_in_the_newest_falls_back_and_is_hashed_once(paths, tmp_path, run_tp,
                                                                   monkeypatch):
    """Sizes intact, two bytes flipped: the run folder's newest is skipped with one warning
    naming the file and the checkpoint used; the previous one, hashed while choosing it,
    is not hashed again by this process nor by the ranks it travels to."""
    from tpkit.weights import files

    run = _damaged_run(paths, tmp_path, flip_two_bytes)
    _save(step_dir(run, 1), 1)  # one more to fall back to: step 2 is hashed when chosen
    hashed = []
    real = files.file_entry
    monkeypatch.setattr(files, "file_entry", lambda path: hashed.append(path) or real(path))
    with pytest.warns(CheckpointWarning) as said:
        source = open_source(run)
    assert [str(w.message) for w in said] == [
        f"{step_dir(run, 4)}: skipped, damaged (model-tp00-pp00.safetensors: checksum "
        f"mismatch (sha256 differs from manifest.json): the file is corrupted); using "
        f"{step_dir(run, 2)}"]
    assert source.root == step_dir(run, 2)
    chose = len(hashed)
    _assert_weights_of([local_state(load_model(source), ParallelMesh.single())], 2)
    assert len(hashed) == chose  # read, not hashed again
    results = run_tp(weights_worker, 2, source)
    _assert_weights_of(results, 2)
    assert run_tp(hashing_worker, 2, source) == [[], []]  # the ranks trust what was hashed
    for step in (2, 1):  # the last one has nothing to fall back to: its reader says it
        flip_two_bytes(step_dir(run, step))
    with pytest.warns(CheckpointWarning) as said, pytest.raises(
            CheckpointError, match="step_000001/model-tp00-pp00.safetensors: checksum mismatch"):
        load_model(run, ParallelMesh.single())
    assert [str(w.message).split(":")[0] for w in said] == [str(step_dir(run, s)) for s in (4, 2)]


def test_a_path_that_is_none_of_these_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    cases = {tmp_path / "empty": "not a checkpoint: neither a tpkit checkpoint",
             tmp_path / "nowhere": "no such file or directory",
             tmp_path / "notes.txt": "not a readable safetensors file"}
    for path, message in cases.items():
        for fn in (open_source, lambda p: load_model(p, ParallelMesh.single())):
            with pytest.raises(CheckpointError) as e:
                fn(path)
            text = str(e.value)
            assert text.startswith(f"{path}: ") and message in text and "\n" not in text


def test_load_refuses_a_full_file_as_a_sharded_checkpoint(paths):
    """The command resolves --resume (`sharded_dir`): a full file is refused there, by
    name; `store.load` itself takes a checkpoint directory and nothing else."""
    with pytest.raises(CheckpointError, match="a full safetensors file, not a sharded"):
        sharded_dir(paths["full"])
    model = Transformer(LLAMA, ParallelMesh.single())
    with pytest.raises(CheckpointError, match="a file, not a checkpoint directory"):
        ckpt.load(paths["full"], model)
    with pytest.raises(CheckpointError, match="manifest.json: missing"):
        ckpt.load(paths["run"], model)  # a run folder is the command's to resolve


# -- every command takes a run folder ------------------------------------------------------
def test_generate_takes_a_run_folder(paths, capsys):
    from tpkit.commands.generate import run

    outs = []
    for path in (paths["run"], paths["sharded"]):
        args = generate_args("--checkpoint", str(path), "--prompt-ids", "1,2,3",
                             "--max-new-tokens", "6", "--max-batch", "8", "--batch-invariant", "--decode-chunk", "8")
        assert run(args) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and len(outs[0].split()) == 6
    args.checkpoint = str(paths["run"].parent / "nowhere")
    with pytest.raises(CheckpointError, match="nowhere: no such file or directory"):
        run(args)  # one line and exit 2 from tpkit.cli


def test_convert_takes_a_run_folder(paths, tmp_path, capsys):
    assert main(["convert", str(paths["run"]), str(tmp_path / "f.safetensors"),
                 "--to", "full"]) == 0
    from safetensors import safe_open

    meta = json.loads(safe_open(str(tmp_path / "f.safetensors"), "pt").metadata()["tpkit"])
    assert meta["step"] == 4
    assert main(["convert", str(paths["run"]), str(tmp_path / "tp2"), "--tp", "2"]) == 0
    assert ckpt.read_manifest(tmp_path / "tp2")["step"] == 4
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpkit convert: error: ") and "no such file or directory" in err


@pytest.mark.timeout(120)
def test_verify_takes_a_run_folder(paths, capsys):
    assert main(["verify", "--checkpoint", str(paths["run"]), "--tp", "2", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert str(paths["sharded"]) in out and "OK: every tp matches tp=1" in out
    assert main(["verify", "--checkpoint", str(paths["run"] / "nowhere")]) == 2


@pytest.mark.timeout(120)
def test_train_resumes_from_a_run_folder(tmp_path, capsys):
    """Checkpoints after steps 1 and 2; the newest damaged: the resumed run redoes step 2."""
    common = ["train", "--preset", "gpt2-tiny", "--global-batch", "2", "--micro-batches", "1",
              "--seq", "16", "--val-fraction", "0", "--no-progress"]
    first = tmp_path / "first"
    assert main([*common, "--steps", "2", "--ckpt-every", "1", "--out", str(first)]) == 0
    truncate(step_dir(first, 2))
    second = tmp_path / "second"
    with pytest.warns(CheckpointWarning, match="step_000002: skipped"):
        assert main([*common, "--steps", "3", "--resume", str(first),
                     "--out", str(second)]) == 0
    rows = [json.loads(r) for r in (second / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3]
    capsys.readouterr()
    assert main([*common, "--steps", "3", "--resume", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such file or directory" in capsys.readouterr().err


# -- the tokenizer travels inside the checkpoint, checked like every file ------------------
def test_the_tokenizer_is_part_of_the_checkpoint(tmp_path):
    from hf_folders import train_tokenizer
    from tpkit.checkpoint.convert import reshard
    from tpkit.weights.sources import source_tokenizer
    from tpkit.weights.tokenizer import load_tokenizer

    tok = train_tokenizer(tmp_path / "tok")
    run, mesh = tmp_path / "run", ParallelMesh.single()
    model = Transformer(LLAMA, mesh)
    for step in STEPS:
        ckpt.save(step_dir(run, step), model, step=step, mesh=mesh, tokenizer=tmp_path / "tok")
    newest = step_dir(run, 4)
    files = ckpt.read_manifest(newest)["files"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= files.keys()
    # a run folder names its latest checkpoint's tokenizer: generate reads the model's ids
    assert source_tokenizer(run) == newest
    text = "tensor parallelism"
    assert load_tokenizer(source_tokenizer(run)).encode(text) == tok.encode(text)
    # reshard carries it, listed in the new manifest too
    assert "tokenizer.json" in ckpt.read_manifest(reshard(run, tmp_path / "tp2", 2))["files"]
    # one flipped byte: a CheckpointError naming the file, not a silently different tokenizer
    data = bytearray((newest / "tokenizer.json").read_bytes())
    data[len(data) // 2] ^= 1
    (newest / "tokenizer.json").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_000004/tokenizer.json: checksum mismatch"):
        source_tokenizer(newest)
    with pytest.warns(CheckpointWarning, match=r"step_000004: skipped, damaged \(tokenizer.json: "
                                               r"checksum mismatch.*using .*step_000002"):
        assert source_tokenizer(run) == step_dir(run, 2)  # the run folder: the one before
    # no tokenizer saved: None (tpkit's presets read bytes)
    ckpt.save(tmp_path / "plain", model, mesh=mesh)
    assert source_tokenizer(tmp_path / "plain") is None


def test_a_shard_pruned_between_two_looks_is_a_missing_shard(tmp_path, monkeypatch):
    """`latest` checks sizes while a run may prune old checkpoints beside it: a shard
    that exists for `is_file` and is gone for its size is missing, not a crash (a CI run
    once raised FileNotFoundError out of `latest` here)."""
    from tpkit.weights.files import size_problem

    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"12345678")
    real, looks = Path.stat, []

    def pruned_after_one_look(self, *args, **kwargs):
        if self == shard:
            looks.append(self)
            if len(looks) > 1:
                raise FileNotFoundError(2, "No such file or directory", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", pruned_after_one_look)
    said = size_problem(tmp_path, shard.name, {"bytes": 8})
    assert len(looks) == 2 and said is not None and "missing shard" in said, (looks, said)
