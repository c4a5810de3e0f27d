"""Models: the `Transformer` (one definition; tp=1 is the reference) and Hugging Face I/O.

The configuration and presets live in `tpkit.spec` (pure Python).
"""

from tpkit.model.transformer import Transformer

__all__ = ["Transformer"]
