"""Weights checked with their own names, through `tpkit generate` (in this process, the
CLI's parser and error path): a Hugging Face folder whose tensor has another shape, or
lacks one, or whose model.safetensors is truncated or not safetensors at all, is one
line naming the tensor as the file names it, its shape and the shape the config
implies (before: a raw size-mismatch traceback; a narrower down_proj was even zero-
padded silently), exit 2."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_folders import tiny_llama_folder
from tpkit.cli import main

K = "model.layers.1.self_attn.k_proj.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    good = tiny_llama_folder(root / "good")
    tensors = load_file(str(good / "model.safetensors"))
    made = {}

    def variant(name: str, change) -> None:
        shutil.copytree(good, root / name)
        made[name] = root / name
        change(root / name / "model.safetensors", dict(tensors))

    def resave(f, t, **new):
        t.update(new)
        save_file({k: v for k, v in t.items() if v is not None}, str(f),
                  metadata={"format": "pt"})

    variant("k_shape", lambda f, t: resave(f, t, **{K: torch.zeros(30, 64)}))
    variant("narrow", lambda f, t: resave(f, t, **{DOWN: torch.zeros(64, 100)}))
    variant("missing", lambda f, t: resave(f, t, **{K: None}))
    variant("truncated", lambda f, t: f.write_bytes(f.read_bytes()[:f.stat().st_size // 2]))
    variant("foreign", lambda f, t: f.write_bytes(b"PK\x03\x04" + b"\0" * 1000))
    return made


CASES = [("k_shape", f"tensor '{K}' has shape [30, 64], the model"),
         ("k_shape", "config) expects [32, 64]"),
         ("narrow", f"tensor '{DOWN}' has shape [64, 100], the model"),
         ("missing", f"no tensor '{K}' (tpkit's layers.1.attn.qkv.weight)"),
         ("truncated", "truncated/model.safetensors: not a readable safetensors file"),
         ("foreign", "foreign/model.safetensors: not a readable safetensors file")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,needle", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_bad_hugging_face_folder_is_one_line_naming_its_tensor(folders, capsys, monkeypatch,
                                                                name, needle):
    monkeypatch.delenv("TPKIT_DEBUG", raising=False)
    capsys.readouterr()
    status = main(["generate", "--checkpoint", str(folders[name]), "--prompt-ids", "1,2",
                   "--max-new-tokens", "1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("tpkit generate: error: ") and needle in lines[0], lines


@pytest.mark.timeout(120)
def test_generate_validates_before_printing(folders, capsys):
    """A prompt longer than the model's context: the error, and nothing on stdout."""
    good = folders["k_shape"].parent / "good"
    capsys.readouterr()
    status = main(["generate", "--checkpoint", str(good), "--prompt", "a" * 300,
                   "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "exceeds the context of 128 tokens" in err, (out, err)
