"""Models: the `Transformer` (one definition; tp=1 is the reference), Hugging Face I/O,
and the Hugging Face family adapters (`tpkit.model.families`, pure Python).

The configuration and presets live in `tpkit.spec` (pure Python). `Transformer` is
imported on first use, so `tpkit.model.families` loads without torch.
"""

__all__ = ["Transformer"]


def __getattr__(name: str):
    if name == "Transformer":
        from tpkit.model.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'tpkit.model' has no attribute {name!r}")
