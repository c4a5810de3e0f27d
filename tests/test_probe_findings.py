"""What an adversarial probe of the CLI found (issue 52), each case as a user hits it:
through `tpkit.cli.main` in this process (the console script's parser and error path),
or in a process of its own where the case needs a memory limit.

Sizes in a config.json are bounded before anything is allocated (num_attention_heads
10^9 took 24 GB and the OOM killer); a config.json or tokenizer that is not one, a full
or read-only disk under convert and prepare-data, a top-p below float32's range, a quiz
answer of '²' or of 10^7 digits, a port out of range: one line, never a traceback.
All 64 bits of a seed count; NaN weights are said; renamed flags keep their old spelling.
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A gpt2-tiny checkpoint and a llama-tiny Hugging Face folder (its byte tokenizer)."""
    from tpkit.checkpoint import store
    from tpkit.checkpoint.convert import to_hf
    from tpkit.mesh import ParallelMesh
    from tpkit.model import Transformer
    from tpkit.spec import get_preset

    root = tmp_path_factory.mktemp("probe")
    for preset in ("gpt2-tiny", "llama-tiny"):
        store.save(root / preset, Transformer(get_preset(preset), ParallelMesh.single(),
                                              seed=0), step=1)
    to_hf(root / "llama-tiny", root / "hf")
    return root


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """`tpkit ARGV` through `tpkit.cli.main` here: (status, stdout, stderr)."""
    from tpkit.cli import main

    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own exit
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(command: str, code: int, err: str, status: int = 2) -> str:
    lines = err.strip().splitlines()
    assert code == status and "Traceback" not in err and len(lines) == 1, (code, err[-2000:])
    assert lines[0].startswith(f"tpkit {command}: error: "), lines
    return lines[0]


def _hf_copy(models: Path, name: str, config: dict | None = None, raw: str | None = None
             ) -> Path:
    """A copy of the Hugging Face folder with config.json changed (or replaced by `raw`)."""
    folder = models / name
    folder.mkdir()
    for f in (models / "hf").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    if raw is not None or config:
        text = raw if raw is not None else json.dumps(
            {**json.loads((folder / "config.json").read_text()), **config})
        (folder / "config.json").write_text(text)
    return folder


def test_config_json_mistakes_are_one_line(models, capsys, monkeypatch):
    monkeypatch.delenv("TPKIT_DEBUG", raising=False)
    cases = [(dict(raw="{not json"), "config.json: not valid JSON"),
             (dict(raw="[]"), "config.json: a JSON list, not an object"),
             (dict(config={"vocab_size": 10 ** 12}),
              "vocab_size=1,000,000,000,000 is above 16,777,216"),
             (dict(config={"num_hidden_layers": "four"}), "num_layers='four' must be an integer"),
             (dict(config={"hidden_size": None}), "hidden=None must be an integer")]
    for i, (change, needle) in enumerate(cases):
        folder = _hf_copy(models, f"bad{i}", **change)
        line = _one_line("generate", *_main(capsys, "generate", "--checkpoint", str(folder),
                                            "--prompt-ids", "1")[::2])
        assert needle in line and str(folder) in line, (needle, line)


@pytest.mark.slow
def test_a_billion_heads_is_refused_before_anything_is_allocated(models):
    """In a process of at most 6 GiB of address space (before: a list of 10^9 head
    indices, then the OOM killer): one line from the CLI, a CheckpointError from
    `tpkit.load`."""
    folder = str(_hf_copy(models, "heads", config={"num_attention_heads": 10 ** 9}))
    script = (f"import sys, tpkit\nfrom tpkit.cli import main\n"
              f"from tpkit.spec.errors import CheckpointError\n"
              f"code = main(['generate', '--checkpoint', {folder!r}, '--prompt-ids', '1'])\n"
              f"try:\n    tpkit.load({folder!r})\nexcept CheckpointError as e:\n"
              f"    print(e)\nsys.exit(code)\n")
    env = dict(os.environ, PYTHONPATH=SRC)
    env.pop("TPKIT_DEBUG", None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=env, timeout=300, preexec_fn=lambda: resource.setrlimit(
                           resource.RLIMIT_AS, (6 << 30, 6 << 30)))
    line = _one_line("generate", r.returncode, r.stderr)
    said = "num_heads=1,000,000,000 is above 16,384, the most tpkit takes"
    assert said in line and said in r.stdout, (line, r.stdout)


def test_weights_larger_than_the_memory_available_are_refused(models, capsys, monkeypatch):
    from tpkit.host.memory import LIMIT_ENV

    monkeypatch.delenv("TPKIT_DEBUG", raising=False)
    monkeypatch.setenv(LIMIT_ENV, "64K")
    line = _one_line("generate", *_main(capsys, "generate", "--checkpoint",
                                        str(models / "hf"), "--prompt-ids", "1")[::2])
    assert "the weights of hf-llama need" in line and f"available ({LIMIT_ENV})" in line, line


def test_a_garbage_tokenizer_is_one_line(models, capsys, monkeypatch):
    monkeypatch.delenv("TPKIT_DEBUG", raising=False)
    folder = _hf_copy(models, "badtok")
    for garbage in ("garbage{", '{"a": 1}'):
        (folder / "tokenizer.json").write_text(garbage)
        line = _one_line("generate", *_main(capsys, "generate", "--checkpoint", str(folder),
                                            "--prompt", "hi")[::2])
        assert f"{folder}: its tokenizer files cannot be read" in line, line


def test_full_and_read_only_disks_under_convert_and_prepare_data(models, tiny_mount, tmp_path,
                                                                 capsys, monkeypatch):
    monkeypatch.delenv("TPKIT_DEBUG", raising=False)
    full, readonly = tiny_mount("512k"), tiny_mount("1m", ro=True)
    src = str(models / "llama-tiny")
    for to, dest, why in (("hf", full / "hf", "No space left on device"),
                          ("full", full / "m.safetensors", "No space left on device"),
                          ("hf", readonly / "hf", "Read-only file system"),
                          ("full", readonly / "m.safetensors", "Read-only file system"),
                          ("sharded", readonly / "ckpt", "Read-only file system")):
        code, _, err = _main(capsys, "convert", src, str(dest), "--to", to)
        line = _one_line("convert", code, err, status=1)
        assert f"{dest}: {why} while writing" in line, line
    assert list(full.iterdir()) == [] and list(readonly.iterdir()) == []
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("tensor parallel " * 100_000)  # 1.6 MB of tokens as uint16: 3.2 MB
    code, _, err = _main(capsys, "prepare-data", str(corpus), "--tokenizer", "bytes",
                         "--out", str(full / "data"), "--no-progress")
    line = _one_line("prepare-data", code, err, status=1)
    assert f"{full / 'data'}: No space left on device while writing" in line, line
    assert list(full.iterdir()) == []


def _sample(capsys, models: Path, *flags: str) -> str:
    code, out, err = _main(capsys, "generate", "--checkpoint", str(models / "gpt2-tiny"),
                           "--prompt-ids", "1,2,3", "--max-new-tokens", "16", *flags)
    assert code == 0, err[-2000:]
    return out


def test_a_top_p_below_float32_is_one_line_and_a_tiny_one_keeps_the_best_token(models,
                                                                                capsys):
    code, _, err = _main(capsys, "generate", "--checkpoint", str(models / "gpt2-tiny"),
                         "--prompt-ids", "1,2,3", "--temperature", "1", "--top-p", "1e-300")
    line = _one_line("generate", code, err, status=2)
    assert "--top-p=1e-300 must be a number in (0, 1]" in line, line
    greedy = _sample(capsys, models, "--temperature", "0")  # float32's smallest top_p:
    assert _sample(capsys, models, "--temperature", "1", "--top-p", "1.5e-45") == greedy


def test_every_bit_of_a_64_bit_seed_counts(models, capsys):
    draws = {seed: _sample(capsys, models, "--temperature", "1", "--seed", str(seed))
             for seed in (7, 7 + (1 << 32), 7 + (1 << 40), 7 - (1 << 63))}
    assert len(set(draws.values())) == len(draws), draws
    assert _sample(capsys, models, "--temperature", "1", "--seed", str(7 + (1 << 40))) == \
        draws[7 + (1 << 40)]


def test_seeds_below_2_32_draw_as_before():
    """`seeded(s)` for s in [0, 2**32) is torch's own `manual_seed(s)`, state for state
    (every sample of such a seed is unchanged); above, both halves make the state."""
    from tpkit.decode.sampling import seeded

    for s in (0, 7, 123456789, (1 << 32) - 1):
        assert torch.equal(seeded(s).get_state(), torch.Generator().manual_seed(s).get_state())
    high = seeded(7 + (1 << 40))
    assert high.initial_seed() == 7 + (1 << 40)
    assert not torch.equal(torch.rand(8, generator=high),
                           torch.rand(8, generator=torch.Generator().manual_seed(7)))


def test_quiz_answers_and_ports_are_one_line(capsys, monkeypatch):
    monkeypatch.delenv("TPKIT_DEBUG", raising=False)
    line = _one_line("quiz", *_main(capsys, "quiz", "--answers", "²,1,2,2,3,1,4,3")[::2])
    assert "--answers, question 1: answer '²' is not a number between 1 and 4" in line, line
    monkeypatch.setattr(sys, "stdin", io.StringIO("1" * 10 ** 7 + "\n"))
    line = _one_line("quiz", *_main(capsys, "quiz")[::2])
    assert "(10,000,000 characters) is not a number between 1 and 4" in line
    assert len(line) < 200, len(line)
    for port in ("-1", "70000"):
        line = _one_line("quiz", *_main(capsys, "quiz", "--web", "--port", port)[::2])
        assert f"--port={port} must be in [0, 65535]" in line, line


def test_nan_weights_are_one_warning_line(models, capsys):
    """Shown as a command shows it (pytest records warnings: they are put back on stderr
    here, through the format the CLI sets)."""
    from safetensors.torch import load_file, save_file

    folder = _hf_copy(models, "nan")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][0, :3] = float("nan")
    tensors["model.norm.weight"][0] = float("inf")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, lineno, file=None, \
            line=None: sys.stderr.write(warnings.formatwarning(message, category, filename,
                                                               lineno, line))
        code, _, err = _main(capsys, "generate", "--checkpoint", str(folder), "--prompt-ids",
                             "1,2", "--max-new-tokens", "2")
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert [x for x in err.splitlines() if "NaN" in x] == [
        f"tpkit generate: warning: {folder}: 2 weight tensor(s) hold NaN or inf: "
        f"final_norm.weight, layers.1.mlp.fc2.weight; the model's outputs will be NaN or "
        f"garbage"], err


def test_renamed_flags_keep_their_old_spelling(tmp_path, capsys):
    from tpkit.cli import _Parser
    from tpkit.commands import calibrate, train

    code, out, err = _main(capsys, "train", "--nproc", "2", "--tp", "2", "--log", "none",
                           "--out", str(tmp_path / "run"), "--print-config")
    assert code == 0, err
    assert err.splitlines() == [
        "tpkit train: warning: --nproc is deprecated, use --processes (under torchrun only "
        "--processes works)",
        "tpkit train: warning: --log is deprecated, use --trackers (under torchrun only "
        "--trackers works)"]
    assert 'log = "none"' in out
    for module, argv in ((train, ["--nproc", "4"]), (calibrate, ["--nproc", "4"])):
        parser = _Parser(prog="tpkit x")
        module.add_arguments(parser)
        assert parser.parse_args(argv).processes == 4
        # hidden (torchrun's own --nproc_per_node may be named in a help text)
        assert not re.search(r"--nproc\b", parser.format_help())
