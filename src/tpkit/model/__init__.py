"""The model as an nn.Module: `Transformer` (one definition; tp=1 is the reference), its
layers (`Block`), the parameter names other packages use (`names`, pure Python), and
`Transformer.generate` (text in, text out: `text`). The decode forward itself (the paged
KV cache, the native decode, the sampler, the generation loop) is `tpkit.decode`'s.

Reading weights (Hugging Face, the family adapters, tokenizers) is `tpkit.weights`'s, run
checkpoints `tpkit.checkpoint`'s; the configuration and presets live in `tpkit.spec`.
`Transformer` is imported on first use, so `tpkit.model.names` loads without torch.
"""

__all__ = ["Transformer"]


def __getattr__(name: str):
    if name == "Transformer":
        # lazy: tpkit.model.names stays torch-free
        from tpkit.model.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'tpkit.model' has no attribute {name!r}")
