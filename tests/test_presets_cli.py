"""`tpkit presets`: every preset and every supported Hugging Face model_type is listed."""

from __future__ import annotations

from tpkit.cli import main
from tpkit.spec.config import PRESETS
from tpkit.weights.families import supported


def test_presets_lists_presets_and_families(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in PRESETS)
    assert all(f"  {kind} " in out for kind in supported())
    assert {"qwen2", "qwen3", "gemma", "phi3", "gpt_neox", "mixtral", "mistral"} <= set(supported())


def test_family_adapters_load_without_torch():
    """The adapters are pure mappings: the planner may read them without torch."""
    import subprocess
    import sys

    code = ("import sys, tpkit.weights.families as f; f.config_from_hf({'model_type': 'qwen2', "
            "'hidden_size': 64, 'num_attention_heads': 4, 'num_hidden_layers': 2, "
            "'intermediate_size': 96, 'vocab_size': 101, 'max_position_embeddings': 64}); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
