"""Nothing destroyed that tpkit did not write, through the real CLI (`tpkit.cli.main`):

- `tpkit convert` writes a new name or an empty folder, replaces its own output of the
  same kind only with --overwrite, and refuses (one line, exit 2, every file kept) a
  folder of the user's, a destination around, inside or equal to its source, or inside a
  run's checkpoints folder; a failed write leaves no temporary;
- a run folder belongs to one run: resuming into another run's folder is refused naming
  both runs, and that folder is byte for byte what it was; `--out` inside a checkpoint,
  a checkpoints folder or a folder of the user's is refused; retention keeps the
  checkpoint just written and deletes only this run's;
- a flipped byte in a run folder's newest checkpoint: `train --resume auto` and
  `generate` use the previous one, with one warning naming both;
- `verify` refuses two models (`--checkpoint` and `--preset`) in one line.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from checkpoint_helpers import LLAMA, fill, random_full
from tpkit.checkpoint import CheckpointWarning, retention
from tpkit.checkpoint import store as ckpt
from tpkit.cli import main
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.weights.paths import step_dir

TRAIN = ["train", "--preset", "gpt2-tiny", "--global-batch", "2", "--micro-batches", "1",
         "--seq", "16", "--val-fraction", "0", "--no-progress", "--ckpt-every", "1"]


def cli(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, stderr) of `tpkit ARGV`."""
    capsys.readouterr()
    status = main(list(argv))
    return status, capsys.readouterr().err


def refused(capsys, *argv: str, status: int = 2) -> str:
    """The one error line of a refused `tpkit ARGV` (exit 2; a disk that fails: 1)."""
    got, err = cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert got == status and len(lines) == 1 and "Traceback" not in err, (got, err[-2000:])
    assert lines[0].startswith(f"tpkit {argv[0]}: error: "), lines
    return lines[0]


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes): what must not change."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _user_folder(path: Path, config_json: bool = False) -> Path:
    (path / "chapters").mkdir(parents=True)
    (path / "thesis.txt").write_text("four years of work")
    (path / "chapters" / "one.txt").write_text("chapter one")
    if config_json:
        (path / "config.json").write_text('{"mine": true}')
    return path


@pytest.fixture
def runs(tmp_path) -> Path:
    """parent/run1 and parent/run2, each a run folder holding one checkpoint (step 4)."""
    mesh = ParallelMesh.single()
    model = Transformer(LLAMA, mesh)
    fill(model, random_full(LLAMA, seed=4), mesh)
    for name in ("run1", "run2"):
        ckpt.save(step_dir(tmp_path / "parent" / name, 4), model, step=4, mesh=mesh)
    return tmp_path / "parent"


@pytest.mark.timeout(120)
def test_convert_never_replaces_what_it_did_not_write(runs, tmp_path, capsys):
    run = str(runs / "run1")
    user = _user_folder(tmp_path / "user", config_json=True)
    before, parent = tree(tmp_path), tree(runs)
    for to in ("sharded", "hf"):
        for extra in ((), ("--overwrite",)):
            line = refused(capsys, "convert", run, str(user), "--to", to, *extra)
            assert f"{user}: exists, a folder holding chapters/, config.json, thesis.txt, " \
                   f"and is not a " in line and "nothing there is replaced" in line, line
    line = refused(capsys, "convert", run, str(user), "--to", "full")
    assert f"{user}: a folder; --to full writes one file" in line, line
    newest = f"{run}/checkpoints/step_000004"
    line = refused(capsys, "convert", run, str(runs), "--to", "sharded")
    assert f"{runs}: holds the source {newest}" in line, line
    line = refused(capsys, "convert", newest, f"{newest}/tp2", "--tp", "2")
    assert f"{newest}/tp2: is or lies inside the source {newest}" in line, line
    line = refused(capsys, "convert", newest, run)
    assert f"{run}: holds the source {newest}" in line, line
    line = refused(capsys, "convert", str(runs / "run2"), f"{run}/checkpoints/tp2")
    assert f"lies inside the checkpoints folder {runs.resolve()}/run1/checkpoints" in line
    assert tree(tmp_path) == before and tree(runs) == parent  # nothing lost, no temporary
    assert cli(capsys, "convert", run, f"{run}/model.safetensors", "--to", "full")[0] == 0


@pytest.mark.timeout(120)
def test_convert_replaces_its_own_output_with_overwrite_only(runs, tmp_path, capsys,
                                                              monkeypatch):
    run = str(runs / "run1")
    outs = {"sharded": tmp_path / "tp2", "hf": tmp_path / "hf", "full": tmp_path / "f.st"}
    what = {"sharded": "sharded tpkit checkpoint", "hf": "Hugging Face folder exported by "
            "tpkit", "full": "tpkit full safetensors file"}
    (tmp_path / "hf").mkdir()  # an empty folder is a fine destination
    for to, out in outs.items():
        assert cli(capsys, "convert", run, str(out), "--to", to, "--tp", "2")[0] == 0
        line = refused(capsys, "convert", run, str(out), "--to", to)
        assert f"{out}: already a {what[to]}; --overwrite replaces it" in line, line
        assert cli(capsys, "convert", run, str(out), "--to", to, "--overwrite")[0] == 0
    assert ckpt.read_manifest(outs["sharded"])["layout"]["tp"] == 1  # replaced: tp=1 now
    line = refused(capsys, "convert", run, str(outs["sharded"]), "--to", "hf", "--overwrite")
    assert "a sharded tpkit checkpoint, not a Hugging Face folder exported by tpkit" in line
    from tpkit.checkpoint import convert

    def full_disk(tensors, path, metadata):  # half a file, then the disk is full
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(convert, "save_file", full_disk)
    before = tree(tmp_path)
    line = refused(capsys, "convert", run, str(outs["full"]), "--to", "full", "--overwrite",
                   status=1)
    assert "No space left on device" in line, line
    assert tree(tmp_path) == before  # the earlier file kept, no temporary left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.st", "hf", "parent", "tp2"]


def _manifests(out: Path) -> dict[int, dict]:
    return {ckpt.read_manifest(d)["step"]: ckpt.read_manifest(d)
            for d in retention.complete(out / "checkpoints")}


@pytest.mark.timeout(300)
def test_a_run_folder_belongs_to_one_run(tmp_path, capsys):
    a, kc, b = tmp_path / "a", tmp_path / "kc", tmp_path / "b"
    assert cli(capsys, *TRAIN, "--steps", "2", "--out", str(a))[0] == 0
    assert cli(capsys, *TRAIN, "--steps", "3", "--seed", "7", "--out", str(kc))[0] == 0
    run_a, run_kc = _manifests(a)[2]["run"], _manifests(kc)[3]["run"]
    assert run_a != run_kc and {m["run"] for m in _manifests(a).values()} == {run_a}
    held = tree(kc)
    line = refused(capsys, *TRAIN, "--steps", "4", "--resume", str(a), "--out", str(kc))
    assert f"--out {kc} holds the checkpoints of another run (run {run_kc}, up to " \
           f"step_000003); this run continues run {run_a} from {step_dir(a, 2)}" in line, line
    assert tree(kc) == held  # its metrics.jsonl (3 rows), config.toml, checkpoints kept
    held = tree(a)
    for inside in (step_dir(a, 2), a / "checkpoints" / "new"):
        line = refused(capsys, *TRAIN, "--steps", "2", "--out", str(inside))
        assert f"--out {inside} is or lies inside the " in line, line
    user = _user_folder(tmp_path / "user")
    line = refused(capsys, *TRAIN, "--steps", "2", "--out", str(user))
    assert f"--out {user} holds files that are not a tpkit run's (chapters/, thesis.txt)" \
        in line, line
    assert tree(a) == held and not (user / "config.toml").exists()
    assert cli(capsys, *TRAIN, "--steps", "3", "--resume", str(a), "--out", str(b))[0] == 0
    assert _manifests(b)[3]["run"] == run_a  # a resumed run keeps its id
    # a rewind in its own folder: the checkpoint just written stays, the later one goes
    status, err = cli(capsys, *TRAIN, "--steps", "2", "--seed", "7", "--keep-checkpoints", "1",
                      "--resume", str(step_dir(kc, 1)), "--out", str(kc))
    assert status == 0, err[-2000:]
    assert sorted(_manifests(kc)) == [2]
    rows = [json.loads(r)["step"] for r in (kc / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2]


def test_retention_deletes_only_this_runs_checkpoints(tmp_path):
    mesh = ParallelMesh.single()
    model = Transformer(LLAMA, mesh)
    folder = tmp_path / "checkpoints"
    for step, run in ((119, "other"), (120, "other"), (5, None), (21, "mine"), (22, "mine")):
        ckpt.save(folder / f"step_{step:06d}", model, step=step, mesh=mesh, run=run)
    gone = retention.prune(folder, 1, run="mine", current=folder / "step_000022")
    assert [d.name for d in gone] == ["step_000005", "step_000021"]  # no id: the folder's
    assert [d.name for d in retention.complete(folder)] == ["step_000022", "step_000119",
                                                            "step_000120"]


def _said(warned) -> list[str]:
    return [str(w.message) for w in warned if w.category is CheckpointWarning]


def _flip_newest(run: Path, step: int) -> None:
    shard = step_dir(run, step) / "model-tp00-pp00.safetensors"
    data = bytearray(shard.read_bytes())
    for i in (len(data) // 2, len(data) // 2 + 7):
        data[i] ^= 0x01
    shard.write_bytes(bytes(data))


@pytest.mark.timeout(300)
def test_a_flipped_byte_in_the_newest_is_skipped_by_resume_and_generate(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli(capsys, *TRAIN, "--steps", "2", "--out", str(run))[0] == 0
    _flip_newest(run, 2)
    said = f"{step_dir(run, 2)}: skipped, damaged (model-tp00-pp00.safetensors: checksum " \
           f"mismatch (sha256 differs from manifest.json): the file is corrupted); using " \
           f"{step_dir(run, 1)}"
    with pytest.warns(CheckpointWarning) as warned:
        status, err = cli(capsys, "generate", "--checkpoint", str(run), "--prompt-ids",
                          "1,2,3", "--max-new-tokens", "4")
    assert status == 0 and _said(warned) == [said], err[-2000:]
    with pytest.warns(CheckpointWarning) as warned:
        status, err = cli(capsys, *TRAIN, "--steps", "3", "--resume", "auto", "--out",
                          str(run))
    assert status == 0 and _said(warned) == [said], err[-2000:]
    rows = [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]  # step 2 done again from step 1
    assert sorted(_manifests(run)) == [1, 2, 3]  # step 2 written anew, whole
    for d in retention.complete(run / "checkpoints"):
        for name, entry in ckpt.read_manifest(d)["files"].items():
            ckpt.verify_file(d, name, entry)


@pytest.mark.timeout(60)
def test_verify_refuses_two_models(runs, capsys):
    line = refused(capsys, "verify", "--checkpoint", str(runs / "run1"), "--preset",
                   "gpt2-tiny", "--tp", "2")
    assert f"--preset gpt2-tiny and --checkpoint {runs / 'run1'}: each names the model" \
        in line, line
    line = refused(capsys, "verify", "--checkpoint", str(runs / "run1"), "--layers", "1")
    assert "--layers 1 overrides a preset's layer count: it needs --preset" in line, line
