"""The rules, once: pure Python, no torch, nothing else of tpkit.

    config.py   ModelConfig (shape, flavour, validation, parameter counts) and presets
    grid.py     the (dp, pp, tp) rank grid: coordinates, groups, node locality
    shapes.py   even ranges (which part a rank owns), stage layers, padded vocabulary, kv heads
    split.py    TPSplit: how a parameter is split over tp, even or not (the pieces a rank holds)
    theory.py   the collectives each layer and step must send, and their ring factors
    errors.py   UserError, CheckpointError, CheckpointWarning: the errors every layer raises
    words.py    plural, did-you-mean, number ranges: how counts and names are written
    lazy.py     a package's names resolved on first use (tpkit, checkpoint, weights)

The runtime (comm, layers, mesh, model, train) and the planner both import these;
an import-linter contract (pyproject.toml) keeps this package free of torch.
"""

from tpkit.spec.config import PRESETS, ModelConfig, get_preset

__all__ = ["PRESETS", "ModelConfig", "get_preset"]
