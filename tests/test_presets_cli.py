"""`tpkit presets`: every preset and every supported Hugging Face model_type is listed."""

from __future__ import annotations

from tpkit.cli import main
from tpkit.model.families import supported
from tpkit.spec.config import PRESETS


def test_presets_lists_presets_and_families(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in PRESETS)
    assert all(f"  {kind} " in out for kind in supported())
    assert {"qwen2", "qwen3", "gemma", "phi3", "gpt_neox", "mixtral", "mistral"} <= set(supported())
