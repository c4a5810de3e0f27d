"""`tpkit prepare-data --out DIR`: nothing destroyed that tpkit did not write, every run's
data its own. Through the real CLI (a `python -m tpkit` process where a signal or a
second process is the point, else `tpkit.cli.main`):

- a second prepare-data into a folder being prepared is refused in one line naming the
  first (the lock of a run folder); the first finishes with its own text and index;
- SIGINT mid-run leaves --out as it was (train reads the old data); SIGKILL leaves a
  hidden sibling, which the next run removes;
- a folder that is not prepared data (a user's file, a training run) is refused and kept;
  prepared data is replaced only with --overwrite, whole (no stale shard stays); a folder
  of shards without index.json (an older, interrupted prepare-data) is refused by train,
  replaced with --overwrite; a shard the index does not list is refused by train.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tpkit.train.data import load_tokens
from tpkit.train.tokens import open_shards

ROOT = Path(__file__).resolve().parents[1]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, stderr) of `tpkit ARGV` in this process."""
    from tpkit.cli import main

    capsys.readouterr()
    status = main(list(argv))
    return status, capsys.readouterr().err


def _prepare(capsys, src: Path, out: Path, *flags: str) -> tuple[int, str]:
    return _cli(capsys, "prepare-data", str(src), "--tokenizer", "bytes", "--out", str(out),
                "--no-progress", *flags)


def _refused(status: int, err: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, (status, err)
    assert lines[0].startswith("tpkit prepare-data: error: ") and needle in lines[0], lines


def _jsonl(path: Path, docs: list[str]) -> list[int]:
    """Write `docs` as JSON Lines; their byte ids (the bytes tokenizer has no EOS)."""
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return [b for d in docs for b in d.encode()]


def _ids(folder: Path) -> list[int]:
    stream, _ = open_shards(folder)
    return np.asarray(stream[:len(stream)]).tolist()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _start(src: Path, out: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen([sys.executable, "-m", "tpkit", "prepare-data", str(src),
                             "--tokenizer", "bytes", "--out", str(out), "--no-progress",
                             "--shard-tokens", "65536", *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, path_of, timeout: float = 60.0) -> Path:
    """Poll until `path_of(proc)` exists (the run is writing), the run still alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = path_of(proc)
        if path.exists():
            return path
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    proc.kill()
    raise AssertionError(f"{path_of(proc)} never appeared")


def _sibling(out: Path):
    return lambda proc: out.parent / f".{out.name}.tpkit-prepare-{proc.pid}"


def _big(tmp_path: Path, name: str, word: str) -> tuple[Path, list[int]]:
    """About 2 MB of JSON Lines: a second or more of tokenizing."""
    src = tmp_path / name
    return src, _jsonl(src, [f"{word} {i} " + f"{word} parallel " * 12 for i in range(10_000)])


@pytest.mark.timeout(240)
def test_a_second_run_into_a_folder_being_prepared_is_refused(tmp_path, capsys):
    """Run 1 (a process) stopped while it writes: run 2 is refused; run 1 killed: only a
    hidden sibling is left, which run 2, retried, removes."""
    first, _ = _big(tmp_path, "first.jsonl", "first")
    second = tmp_path / "second.jsonl"
    want = _jsonl(second, ["the second source"])
    out = tmp_path / "data"
    proc = _start(first, out)
    half = _wait_for(proc, lambda p: _sibling(out)(p) / "shard_00000.bin").parent
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        status, err = _prepare(capsys, second, out, "--overwrite")
        _refused(status, err, f"--out {out} is in use by another run (pid {proc.pid} on host ")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    assert [p.name for p in out.iterdir()] == [".tpkit-run.lock"]  # nothing looks complete
    assert half.is_dir()
    status, err = _prepare(capsys, second, out)
    assert status == 0, err
    assert f"taking over the lock of a run that ended without releasing it (pid {proc.pid} " \
           in err and f"removed 1 leftover folder(s) of an interrupted prepare-data: " \
           f"{half.name}" in err, err
    index = json.loads((out / "index.json").read_text())
    assert index["sources"] == [str(second)] and _ids(out) == want
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_interrupted_run_leaves_the_folder_as_it_was(tmp_path, capsys, monkeypatch):
    """SIGINT (sent to this process, as Ctrl-C would) while the second shard starts."""
    from tpkit.train.tokens import ShardWriter

    old = tmp_path / "old.jsonl"
    want = _jsonl(old, ["the data prepared first"] * 3)
    out = tmp_path / "data"
    assert _prepare(capsys, old, out)[0] == 0
    before = _snapshot(out)
    new, _ = _big(tmp_path, "new.jsonl", "new")
    roll = ShardWriter._roll

    def interrupted(self):
        if self.shards:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler raises here
        roll(self)

    monkeypatch.setattr(ShardWriter, "_roll", interrupted)
    status, err = _prepare(capsys, new, out, "--overwrite", "--shard-tokens", "65536")
    assert status == 128 + signal.SIGINT and err.strip() == \
        "tpkit prepare-data: stopped by SIGINT", err
    assert _snapshot(out) == before and list(load_tokens(out, 256, "bytes")) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "new.jsonl", "old.jsonl"]


def test_a_folder_that_is_not_prepared_data_is_refused_and_kept(tmp_path, capsys):
    src = tmp_path / "a.jsonl"
    _jsonl(src, ["some text"])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    run = tmp_path / "run"  # what `tpkit train --out run` leaves
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    for name in ("config.toml", "metrics.jsonl", ".tpkit-run.lock"):
        (run / name).write_text(f"{name} of a training run")
    run_files = _snapshot(run)
    for out, needle in ((mine, "holds files prepare-data did not write (1: notes.txt)"),
                        (run, "holds files prepare-data did not write (3: checkpoints, config.toml, "
                              "metrics.jsonl)")):
        for flags in ((), ("--overwrite",)):
            status, err = _prepare(capsys, src, out, *flags)
            _refused(status, err, f"--out {out} is not empty and {needle}")
    assert (mine / "notes.txt").read_text() == "my notes" and _snapshot(run) == run_files
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]  # not even a lock file
    afile = tmp_path / "afile"
    afile.write_text("x")
    _refused(*_prepare(capsys, src, afile), f"--out {afile} is a regular file, not a folder")
    _refused(*_prepare(capsys, tmp_path / "missing.jsonl", tmp_path / "new"), "does not exist")
    assert not (tmp_path / "new").exists()  # nothing created for a refused input
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')  # found while writing, under the lock
    _refused(*_prepare(capsys, broken, tmp_path / "new"), "broken.jsonl line 2: not JSON")
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["a.jsonl", "afile", "broken.jsonl", "mine", "run"]  # no folder, no sibling left


def test_prepared_data_is_replaced_whole_and_only_with_overwrite(tmp_path, capsys):
    many, one = tmp_path / "many.jsonl", tmp_path / "one.jsonl"
    _jsonl(many, ["x" * 100] * 3)
    want = _jsonl(one, ["short"])
    out = tmp_path / "data"
    assert _prepare(capsys, many, out, "--shard-tokens", "100")[0] == 0
    assert len(list(out.glob("shard_*.bin"))) == 3
    status, err = _prepare(capsys, one, out)
    _refused(status, err, f"--out {out} holds data prepared earlier (3 documents, 300 tokens "
                          f"of {many}); replace it with --overwrite, or choose another --out")
    assert _prepare(capsys, one, out, "--overwrite")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == [".tpkit-run.lock", "index.json",
                                                     "shard_00000.bin"]  # no stale shard
    assert _ids(out) == want and json.loads((out / "index.json").read_text())["sources"] == \
        [str(one)]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_two_renames_where_the_file_system_cannot_exchange(tmp_path, capsys, monkeypatch):
    import errno

    import tpkit.train.data_folder as folder

    def no_exchange(a, b):
        raise OSError(errno.EINVAL, "no RENAME_EXCHANGE here")

    monkeypatch.setattr(folder, "_exchange", no_exchange)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _jsonl(a, ["first"])
    want = _jsonl(b, ["second"])
    out = tmp_path / "data"
    assert _prepare(capsys, a, out)[0] == 0 and _prepare(capsys, b, out, "--overwrite")[0] == 0
    assert _ids(out) == want and sorted(p.name for p in tmp_path.iterdir()) == \
        ["a.jsonl", "b.jsonl", "data"]


def test_train_refuses_shards_their_index_does_not_describe(tmp_path, capsys):
    src = tmp_path / "a.jsonl"
    want = _jsonl(src, ["y" * 50] * 4)
    out = tmp_path / "data"
    assert _prepare(capsys, src, out, "--shard-tokens", "64")[0] == 0
    (out / "index.json").rename(tmp_path / "index.json")  # as an interrupted old run left it
    (out / ".shard_00004.bin.tmp").write_bytes(b"\0\0")
    train = ["train", "--steps", "1", "--seq", "16", "--global-batch", "1", "--no-progress",
             "--data", str(out)]
    status, err = _cli(capsys, *train, "--out", str(tmp_path / "r1"))
    assert status == 2 and f"data folder {out} holds token shards but no index.json" in err
    (tmp_path / "index.json").rename(out / "index.json")
    status, err = _cli(capsys, *train, "--out", str(tmp_path / "r2"))
    assert status == 2 and err.count("\n") == 1 and \
        f"{out}: .shard_00004.bin.tmp not in index.json (it lists 4 shard(s))" in err, err
    (out / "index.json").unlink()
    _refused(*_prepare(capsys, src, out), "holds token shards without a valid index.json")
    assert _prepare(capsys, src, out, "--overwrite")[0] == 0 and _ids(out) == want
