"""Models: `ModelConfig` and presets (pure Python), the `Transformer`, Hugging Face I/O.

Light on import: `tpkit.model.config` needs no torch (the planner uses it).
"""

from tpkit.model.config import PRESETS, ModelConfig, get_preset

__all__ = ["PRESETS", "ModelConfig", "get_preset"]


def __getattr__(name: str):
    if name == "Transformer":
        from tpkit.model.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'tpkit.model' has no attribute {name!r}")
