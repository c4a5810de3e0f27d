"""One error path for every command: each user mistake below, run through the CLI's
entry (`tpkit.cli.main`, in this process: ~25 fresh interpreters importing torch cost
40 s here), prints exactly one line `tpkit <command>: error: ...` naming the cause (and
its numbers), gives status 2, and prints no traceback; three of them (a parse error, a
refused checkpoint, a busy port) also run as real `tpkit` processes, whose exit status
and stderr are checked the same way; `--debug` brings the traceback back."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _tpkit(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TPKIT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "tpkit", *argv], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A gpt2-tiny and a llama-tiny checkpoint, a run folder, a file that is not one."""
    from tpkit.checkpoint import store
    from tpkit.mesh import ParallelMesh
    from tpkit.model import Transformer
    from tpkit.spec import get_preset

    root = tmp_path_factory.mktemp("cli")
    for preset in ("gpt2-tiny", "llama-tiny"):
        model = Transformer(get_preset(preset), ParallelMesh.single(), seed=0)
        store.save(root / preset, model, step=1)
    (root / "run" / "checkpoints").mkdir(parents=True)
    model = Transformer(get_preset("gpt2-tiny"), ParallelMesh.single(), seed=0)
    store.save(root / "done" / "checkpoints" / "step_000001", model, step=1)
    (root / "notes.safetensors").write_text("not a safetensors file")
    return root


def _cases(root: Path, port: int) -> list[tuple[list[str], str]]:
    g, llama = str(root / "gpt2-tiny"), str(root / "llama-tiny")
    gen = ["generate", "--checkpoint", g]
    train = ["train", "--steps", "2", "--seq", "16", "--out", str(root / "out")]
    return [
        (["train", "--tp", "two"], "argument --tp: invalid int value: 'two'"),
        (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (train + ["--processes", "0"], "--processes=0 must be a positive number"),
        (train + ["--processes", "-1"], "--processes=-1 must be a positive number"),
        (train + ["--warmup", "-1"], "warmup=-1 must be an integer >= 0"),
        (train + ["--ckpt-every", "-1"], "ckpt_every=-1 must be an integer >= 0"),
        (train + ["--clip", "-1"], "clip=-1.0 must be a number >= 0"),
        (train + ["--resume", str(root / "missing")], "missing: no such file or directory"),
        (train + ["--resume", llama], "written for a different model"),
        (["train", "--steps", "2", "--out", str(root / "done")],
         "holds an earlier run (checkpoints up to step_000001); continue it with --resume"),
        (["verify", "--preset", "gpt3-huge"], "unknown preset 'gpt3-huge'"),
        (["verify", "--preset", "gpt2-tiny", "--tp", "0,2"], "tp=0 must be a positive"),
        (["verify", "--preset", "gpt2-tiny", "--seq", "4096"],
         "sequence length 4096 exceeds max_seq_len=128"),
        (gen + ["--tp", "5", "--prompt-ids", "1"], "tp=5 is more than num_heads=4"),
        (gen + ["--prompt-ids", "1,999"], "token ids [999] are outside the model's vocabulary"),
        (gen + ["--prompt-ids", "1", "--temperature", "nan"], "--temperature=nan must be"),
        (gen + ["--prompt-ids", "1", "--temperature", "-1"], "--temperature=-1.0 must be"),
        (gen + ["--prompt-ids", "1", "--top-k", "-3"], "--top-k=-3 must be an integer >= 0"),
        (gen + ["--prompt-ids", "1", "--seed", str(1 << 64)],  # the server's bound too
         f"--seed={1 << 64} must be a 64-bit integer"),
        (gen + ["--prompt-ids", "1", "--max-new-tokens", "-1"], "--max-new-tokens=-1 must"),
        (["serve", "--checkpoint", g, "--itl-ratio", "1"], "--itl-ratio=1.0 must be > 1"),
        (["serve", "--checkpoint", g, "--timeout", "nan"], "--timeout=nan must be a number"),
        (["serve", "--checkpoint", g, "--timeout", "inf"], "--timeout=inf must be a number"),
        (["serve", "--checkpoint", g, "--drain-seconds", "nan"], "--drain-seconds=nan must be"),
        (["generate", "--checkpoint", str(root / "run"), "--prompt-ids", "1"],
         "neither a tpkit checkpoint"),
        (["generate", "--checkpoint", str(root / "notes.safetensors"), "--prompt-ids", "1"],
         "not a readable safetensors file"),
        (["convert", str(root / "missing"), str(root / "x.safetensors"), "--to", "full"],
         "missing"),
        (["quiz", "--web", "--port", str(port)], f"port {port} is already in use"),
    ]


def _in_process(argv: list[str], capsys) -> tuple[int, str]:
    """`tpkit ARGV` through `tpkit.cli.main` here: (status, stderr)."""
    from tpkit.cli import main

    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own exit
        code = e.code
    return code, capsys.readouterr().err


def _check(argv: list[str], needle: str, code: int, stderr: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, (argv, code, stderr[-1500:])
    assert "Traceback" not in stderr and len(lines) == 1, (argv, stderr[-1500:])
    assert lines[0].startswith(f"tpkit {argv[0]}: error: "), (argv, lines)
    assert needle in lines[0], (argv, needle, lines[0])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_user_mistake_is_one_line_and_exit_2(files, capsys, monkeypatch):
    monkeypatch.delenv("TPKIT_DEBUG", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = _cases(files, busy.getsockname()[1])
        for argv, needle in cases:
            _check(argv, needle, *_in_process(argv, capsys))
        real = [cases[0], cases[-4], cases[-1]]  # parse error, refused file, busy port
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda c: _tpkit(*c[0]), real))
    for (argv, needle), r in zip(real, results):
        _check(argv, needle, r.returncode, r.stderr)


def test_debug_shows_the_traceback_of_a_user_mistake():
    quiet = _tpkit("verify", "--preset", "gpt3-huge")
    loud = _tpkit("verify", "--preset", "gpt3-huge", "--debug")
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    assert loud.returncode != 0 and "Traceback" in loud.stderr and "UserError" in loud.stderr


def test_a_bug_keeps_its_traceback():
    from tpkit.cli import explain
    from tpkit.comm.failure import CollectiveFailed
    from tpkit.launch import SpawnError
    from tpkit.spec.errors import UserError

    assert explain(KeyError("x")) is None and explain(RuntimeError("shape")) is None
    assert explain(UserError("bad")) == ("bad", 2)
    assert explain(SpawnError("rank 1 raised KeyError", 1, KeyError("x"))) is None
    assert explain(SpawnError("...", 1, UserError("tp=3"))) == ("rank 1: tp=3", 2)
    failed = CollectiveFailed("all_reduce", "tp", (0, 1), 0, "layers.1.mlp", "forward", 5.0,
                              "Timed out waiting 5000ms for recv operation", step=7)
    assert explain(failed)[1] == 1 and "suspects: rank 1" in explain(failed)[0]
