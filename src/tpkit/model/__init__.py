"""Models: `ModelConfig` and presets (pure Python), the `Transformer`, Hugging Face I/O.

Light on import: `tpkit.model.config` needs no torch (the planner uses it).
"""

from tpkit.model.config import PRESETS, ModelConfig, get_preset

__all__ = ["PRESETS", "ModelConfig", "get_preset"]
