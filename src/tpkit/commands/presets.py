"""`tpkit presets`: the model presets (`--preset NAME`) and the Hugging Face families
that `--from-hf`, `tpkit generate`, `tpkit convert` and `tpkit verify --hf` read.

    tpkit presets
"""

from __future__ import annotations

import argparse

from tpkit.spec.config import PRESETS, ModelConfig
from tpkit.weights.families import BY_MODEL_TYPE, presets_of


def _size(c: ModelConfig) -> str:
    n = c.num_params()
    return next(f"{n / d:.1f}{u}" for d, u in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, ""))
                if n >= d or d == 1)


def _features(c: ModelConfig) -> str:
    kv = f", {c.kv_heads} kv heads" if c.kv_heads != c.num_heads else ""
    return f"{c.norm}, {c.activation}, {c.position}{kv}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    """Print both lists."""
    print("presets (--preset NAME):")
    print(f"  {'name':<12} {'family':<8} {'params':>7}  {'h':>6} {'layers':>6} {'heads':>5}"
          f"  flavour")
    for name, c in PRESETS.items():
        print(f"  {name:<12} {c.family or '-':<8} {_size(c):>7}  {c.hidden:>6} "
              f"{c.num_layers:>6} {c.num_heads:>5}  {_features(c)}")
    print("\nHugging Face families (model_type in config.json -> adapter):")
    for kind, fam in sorted(BY_MODEL_TYPE.items()):
        names = presets_of(kind)
        presets = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
        print(f"  {kind:<10} {fam.summary}" + (f"  [presets: {presets}]" if presets else ""))
    return 0
