"""The first hour of a new user, through the real CLI: what a command says must be true
and read in the user's terms.

Checked: `tpkit version` finds the mlflow that `--log mlflow` imports (any distribution
of the module); a reader of stdout gone (`| head -1`) ends presets, version, plan and
the quiz quietly with status 141, no traceback and nothing at the interpreter's exit;
tpkit's own warnings read `tpkit <command>: warning: ...`, one line (the library's
formatter untouched); `convert` names the checkpoint a run folder gave; `generate
--chat` without a chat template says to drop --chat (the server keeps its endpoint
words); the train summary names cp and the micro-batches, which default to what the
pipeline needs (a flag or the TOML file still wins); counts read '1 prompt', '4
micro-batches'; an unknown preset gets the nearest names; a tp the model refuses is one
line naming it once and the tp sizes that work; `dir(tpkit)` lists the lazy names
without importing torch; the quiz scores `--answers` by the seed's numbering under
--shuffle, and `quiz --web` stopped by SIGTERM exits 143.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from tpkit.cli import main
from tpkit.spec.words import number_ranges, plural, suggest

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           PYTHONUNBUFFERED="1")
SEED_ANSWERS = "1,2,3,4,1,2,3,4"  # the seed quiz's right options, numbered as it lists them


def _tpkit(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpkit", *argv], capture_output=True,
                          text=True, env=ENV, timeout=300, **kw)


# -- 1. tpkit version ---------------------------------------------------------------------
def test_version_finds_the_module_that_log_mlflow_imports(capsys):
    assert main(["version"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[:1] == ["mlflow"])
    assert ("not installed" in line) == (importlib.util.find_spec("mlflow") is None), line


def test_a_module_from_a_distribution_of_another_name(tmp_path, monkeypatch):
    """`mlflow` installed by mlflow-skinny: the version of the distribution that has it."""
    from tpkit.commands.version import module_version

    (tmp_path / "fakemod").mkdir()
    (tmp_path / "fakemod" / "__init__.py").write_text("")
    info = tmp_path / "fakemod_skinny-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakemod-skinny\n"
                                   "Version: 1.2.3\n")
    (info / "top_level.txt").write_text("fakemod\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert module_version("fakemod") == "fakemod-skinny 1.2.3"
    assert module_version("no_such_module_here") is None


# -- 2. a closed pipe -----------------------------------------------------------------------
def _reader_gone(argv: list[str], first_line: bool) -> tuple[int, str, str]:
    """Run `tpkit argv` into a real pipe whose reader goes away: before the command starts,
    or (`first_line`) after reading its first line, byte by byte, from a pipe of one page
    (so the rest cannot all be written before the reader goes)."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    if not first_line:
        os.close(r)
    proc = subprocess.Popen([sys.executable, "-m", "tpkit", *argv], stdout=w,
                            stderr=subprocess.PIPE, env=ENV)
    os.close(w)
    line = b""
    if first_line:
        while not line.endswith(b"\n"):
            byte = os.read(r, 1)
            if not byte:
                break
            line += byte
        os.close(r)
    err = proc.communicate(timeout=300)[1].decode()
    return proc.returncode, line.decode(), err


@pytest.mark.timeout(600)
@pytest.mark.parametrize("argv", [
    ["presets"], ["version"], ["quiz", "--answers", SEED_ANSWERS],
    ["plan", "--preset", "gpt2-124m", "--nodes", "1", "--gpus-per-node", "2",
     "--hardware", "h100"]], ids=lambda a: a[0])
def test_a_reader_gone_ends_the_command_quietly(argv):
    status, _, err = _reader_gone(argv, first_line=False)
    assert status == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception" not in err, err


@pytest.mark.timeout(300)
def test_head_1_of_the_quiz():
    status, line, err = _reader_gone(["quiz", "--level", "2", "--answers", SEED_ANSWERS],
                                     first_line=True)
    assert line == "Question 1/8\n" and status == 141, (line, err)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


# -- 3. warnings, 11. convert names what it read ------------------------------------------
@pytest.mark.timeout(300)
def test_warning_is_one_line_and_convert_says_what_it_read(tmp_path):
    from tpkit.checkpoint import store
    from tpkit.checkpoint.paths import step_dir
    from tpkit.mesh import ParallelMesh
    from tpkit.model import Transformer
    from tpkit.spec import get_preset

    model = Transformer(get_preset("gpt2-tiny"), ParallelMesh.single(), seed=0)
    run = tmp_path / "run"
    for step in (2, 4):
        store.save(step_dir(run, step), model, step=step)
    shard = step_dir(run, 4) / "model-tp00-pp00.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])  # the newest is damaged: skipped, warned
    r = _tpkit("convert", str(run), str(tmp_path / "full.safetensors"), "--to", "full")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"read {step_dir(run, 2)}"
    said = r.stderr.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("tpkit convert: warning: "), r.stderr
    assert "step_000004: skipped, damaged" in said[0] and ".py:" not in r.stderr


def test_the_library_keeps_pythons_warning_format(capsys):
    before = warnings.formatwarning
    assert main(["presets"]) == 0
    assert warnings.formatwarning is before
    capsys.readouterr()


# -- 4. generate --chat in CLI words, 6. plurals --------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tpkit.checkpoint import store
    from tpkit.mesh import ParallelMesh
    from tpkit.model import Transformer
    from tpkit.spec import get_preset

    path = tmp_path_factory.mktemp("tiny") / "gpt2-tiny"
    store.save(path, Transformer(get_preset("gpt2-tiny"), ParallelMesh.single(), seed=0),
               step=1)
    return path


def test_chat_without_a_template_says_what_to_do_in_cli_terms(tiny, capsys):
    from tpkit.checkpoint.tokenizer import ByteTokenizer
    from tpkit.serve.openai_api import ApiError, chat_ids

    assert main(["generate", "--checkpoint", str(tiny), "--chat", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tpkit generate: error: --chat: ") and "drop --chat" in err, err
    assert "/v1/" not in err
    with pytest.raises(ApiError, match="use /v1/completions with a prompt instead"):
        chat_ids({"messages": [{"role": "user", "content": "x"}]}, ByteTokenizer(),
                 threading.Lock())


def test_one_prompt_is_one_prompt(tiny, capsys):
    assert main(["generate", "--checkpoint", str(tiny), "--prompt", "hi",
                 "--max-new-tokens", "1"]) == 0
    assert "[1 token (1 prompt) in " in capsys.readouterr().err


# -- 5. cp in the summary, 7. the micro-batches a pipeline needs ----------------------------
def _config(*flags: str, world: int | None = None):
    from tpkit.commands.train import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(flags)), world)


def test_micro_batches_default_to_what_the_pipeline_needs(tmp_path):
    from tpkit.spec.shapes import MICRO_BATCHES_PER_STAGE

    assert _config().micro_batches == 1  # pp=1: one
    for flags, world in ((["--pp", "2"], None), (["--pp", "2", "--global-batch", "6"], None),
                         (["--pp", "4", "--global-batch", "64"], None),
                         (["--pp", "2", "--global-batch", "12"], 4),
                         (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                           "--global-batch", "6"], None)):
        cfg = _config(*flags, world=world)
        assert cfg.micro_batches > 1 and cfg.problems() == [], (flags, cfg.micro_batches)
        assert cfg.micro_batches <= MICRO_BATCHES_PER_STAGE * cfg.pp
    assert _config("--pp", "2", "--micro-batches", "1").micro_batches == 1  # a flag wins
    toml = tmp_path / "run.toml"
    toml.write_text("[parallelism]\npp = 2\n[training]\nmicro_batches = 2\n")
    assert _config("--config", str(toml)).micro_batches == 2  # so does the file


def _train(mesh, cfg):
    from tpkit.train.loop import train

    return train(cfg, mesh)


@pytest.mark.timeout(300)
def test_the_summary_names_cp_and_the_micro_batches(run_tp, tmp_path):
    from tpkit.train.report import report

    cfg = _config("--pp", "2", "--cp", "2", "--steps", "1", "--seq", "32", "--processes", "4",
                  "--out", str(tmp_path / "run"), world=4)
    cfg = cfg.with_(progress=False, plot=False, checkpoint=False, val_fraction=0.0,
                    log="none")
    result = run_tp(_train, 1, cfg, pp=2, dp=2)[0]
    first = report(result, []).splitlines()[0]
    assert f"tp=1 x pp=2 x dp=1 x cp=2 (1f1b, {cfg.micro_batches} micro-batches of " in first
    assert cfg.micro_batches == 4 and result.bubble_theory == 1 / 4


# -- 6. plurals, 8. did you mean a preset, 9. a tp the model refuses ------------------------
def test_plural_and_number_ranges():
    assert [plural(1, "prompt"), plural(2, "micro-batch"), plural(0, "process"),
            plural(12345, "token", fmt=",")] == \
        ["1 prompt", "2 micro-batches", "0 processes", "12,345 tokens"]
    assert number_ranges([8, 1, 2, 3, 4, 6]) == "1-4, 6, 8" and number_ranges([1, 2]) == "1, 2"
    assert suggest("--lrr", ["--lr", "--seed"]) == "; did you mean --lr?"


@pytest.mark.parametrize("command", ["train", "plan"])
def test_unknown_preset_names_the_nearest(command, capsys):
    extra = ["--nodes", "1", "--gpus-per-node", "8", "--hardware", "h100"] * (command == "plan")
    assert main([command, "--preset", "gpt2-tinyy", *extra]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "unknown preset 'gpt2-tinyy'; did you mean gpt2-tiny" in err[0]


def test_a_refused_tp_names_the_model_once_and_the_tp_that_work(capsys):
    from tpkit.spec import get_preset

    model = get_preset("gpt2-tiny")
    bad = next(t for t in range(2, 9) if model.problems(tp=t))
    works = [t for t in range(1, model.num_heads + 1) if not model.problems(tp=t)]
    assert main(["train", "--preset", "gpt2-tiny", "--tp", str(bad), "--steps", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].count("gpt2-tiny:") == 1, err
    assert err[0].endswith(f"(the tp sizes that work: {number_ranges(works)})"), err


# -- 10. dir(tpkit) ---------------------------------------------------------------------------
def test_dir_lists_the_lazy_names_without_importing_torch():
    code = ("import sys, tpkit; names = dir(tpkit); "
            "print(all(n in names for n in tpkit.__all__), 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                       timeout=60)
    assert r.stdout.split() == ["True", "False"], r.stdout + r.stderr


# -- 12. the quiz ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [[], ["--seed", "0"], ["--seed", "1"], ["--seed", "7"]])
def test_answers_are_numbered_as_in_the_seed_quiz_under_shuffle(seed, capsys):
    for _ in range(1 if seed else 8):  # no seed: the real random shuffle, 8 sittings
        assert main(["quiz", "--answers", SEED_ANSWERS, "--shuffle", *seed]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[-1] == "Score: 8/8", out[-12:]


@pytest.mark.timeout(120)
def test_the_web_quiz_stopped_by_sigterm_exits_128_plus_15():
    proc = subprocess.Popen([sys.executable, "-m", "tpkit", "quiz", "--web", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert "http://" in proc.stdout.readline()  # serving: its handlers are in place
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
