"""The rules, once: pure Python, no torch.

The model configuration and presets, the per-layer collective theory, the rank grid,
and the small formulas that both the runtime and the planner need. Everything above
imports these; nothing here imports torch or any other part of tpkit.
"""

from tpkit.spec.config import PRESETS, ModelConfig, get_preset

__all__ = ["PRESETS", "ModelConfig", "get_preset"]
