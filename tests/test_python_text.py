"""Text in, text out from Python: `tpkit.load(folder)` carries the folder's tokenizer and
`model.generate("text" or [texts], ...)` returns text, the text `transformers` generates
(greedy), whole or streamed; ids still give ids; a model without a tokenizer says so."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpkit
from tpkit.spec.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Tensor parallelism splits", "the pipeline"]


@pytest.fixture(scope="module")
def model(chat_llama):
    return tpkit.load(chat_llama)


def _transformers_text(folder, prompt: str, n: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt")
    out = hf.generate(**ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_text_in_gives_the_text_transformers_generates(model, chat_llama):
    want = [_transformers_text(chat_llama, p, 12) for p in PROMPTS]
    assert all(want)  # the random model says something
    assert model.generate(PROMPTS[0], max_new_tokens=12) == want[0]
    assert model.generate(PROMPTS, max_new_tokens=12) == want  # a batch: each as alone


def test_streamed_pieces_join_into_the_same_text(model):
    pieces = model.generate(PROMPTS[0], max_new_tokens=12, stream=True)
    assert not isinstance(pieces, str)
    assert "".join(pieces) == model.generate(PROMPTS[0], max_new_tokens=12)


def test_ids_still_give_ids(model):
    ids = model.tokenizer.encode(PROMPTS[0])
    out = model.generate([ids], max_new_tokens=4)
    assert torch.is_tensor(out) and out[0, :len(ids)].tolist() == ids


def test_a_model_without_a_tokenizer_says_so(tmp_path, chat_llama):
    import shutil

    for name in ("config.json", "model.safetensors"):  # the weights, no tokenizer files
        shutil.copy(chat_llama / name, tmp_path / name)
    bare = tpkit.load(tmp_path)
    assert bare.tokenizer is None
    with pytest.raises(UserError, match="this model carries no tokenizer"):
        bare.generate("hello", max_new_tokens=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_docs_text_example_runs(tmp_path, chat_llama):
    text = (ROOT / "docs" / "python.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, re.S)[1]  # the second: text
    (tmp_path / "text.py").write_text(block)
    out = subprocess.run([sys.executable, str(tmp_path / "text.py"), str(chat_llama)],
                         capture_output=True, text=True, timeout=280,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()
