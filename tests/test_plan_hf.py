"""`tpkit plan --hf FOLDER`: any Hugging Face folder tpkit loads is planned, and every
plan prints the `tpkit train` line that runs it (a preset's, a folder's, a shape typed
by hand's, with its placeholders explained)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from tpkit.cli import main as tpkit_main


def _printed(capsys, argv: list[str]) -> str:
    assert tpkit_main(argv) == 0
    return capsys.readouterr().out


def _train_line(out: str) -> str:
    return next(x.strip() for x in out.splitlines() if "tpkit train" in x)


@pytest.fixture(scope="module")
def folder_and_data(tmp_path_factory, chat_llama):
    from hf_folders import TEXT

    root, folder = tmp_path_factory.mktemp("plan_hf"), chat_llama  # a tiny Llama folder
    (root / "corpus.txt").write_text(TEXT)
    assert tpkit_main(["prepare-data", str(root / "corpus.txt"), "--tokenizer", str(folder),
                       "--out", str(root / "data")]) == 0
    return folder, root / "data"


@pytest.mark.slow
def test_the_top_plan_of_a_folder_runs_as_printed(capsys, folder_and_data, tmp_path):
    folder, data = folder_and_data
    out = _printed(capsys, ["plan", "--hf", str(folder), "--hardware", "cpu",
                            "--gpus-per-node", "2", "--seq", "32", "--global-batch", "4",
                            "--data", str(data)])
    line = _train_line(out)
    assert line.startswith(f"tpkit train --from-hf {folder} --data {data} ")
    argv = shlex.split(line)[1:] + ["--steps", "2", "--out", str(tmp_path / "run"),
                                    "--trackers", "none", "--no-plot", "--no-progress",
                                    "--no-checkpoint"]
    done = subprocess.run([sys.executable, "-m", "tpkit", *argv], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r][-1] == 2


def test_a_folder_is_planned_in_json_with_its_placeholders_named(capsys, folder_and_data):
    folder, _ = folder_and_data
    rows = json.loads(_printed(capsys, ["plan", "--from-hf", str(folder), "--hardware", "cpu",
                                        "--gpus-per-node", "4", "--seq", "32", "--json"]))
    assert rows and all(r["pp"] <= 4 for r in rows)  # the folder's 4 layers
    first = rows[0]["commands"]
    assert first["tpkit"].startswith(f"tpkit train --from-hf {folder} --data DATA_DIR ")
    assert f"--tokenizer {folder} --out DATA_DIR" in first["tpkit_placeholders"]


def test_a_shape_typed_by_hand_says_how_to_run_it(capsys):
    out = _printed(capsys, ["plan", "--heads", "32", "--hidden", "4096", "--layers", "32",
                            "--vocab", "152064", "--kv-heads", "8", "--ffn", "11008",
                            "--swiglu", "--nodes", "2", "--top", "2"])
    assert "cannot run" not in out
    line = _train_line(out)
    assert "-m tpkit train --from-hf FOLDER --data DATA_DIR --tp " in line
    assert "FOLDER: a Hugging Face model folder of this shape" in " ".join(out.split())


def test_a_preset_prints_its_preset_line_and_both_at_once_is_one_line(capsys):
    assert "-m tpkit train --preset llama3-8b --tp " in _train_line(
        _printed(capsys, ["plan", "--preset", "llama3-8b", "--top", "1"]))
    assert tpkit_main(["plan", "--preset", "llama3-8b", "--hf", "x"]) == 2
    assert "give --preset or --hf, not both" in capsys.readouterr().err
    assert tpkit_main(["plan", "--hf", "no-such-folder"]) == 2
    assert "no-such-folder/config.json: missing" in capsys.readouterr().err
