"""How an encoder's hidden states become one embedding per input, as sentence-transformers
computes it from a model folder's own files:

    pooling = read_pooling("all-MiniLM-L6-v2")   # modules.json, 1_Pooling/config.json, ...
    vectors = pooling(hidden, mask)              # [b, s, h], [b, s] -> [b, h] float32

- `modules.json` lists the pipeline: `sentence_transformers.models.Transformer`, then
  `Pooling` (its folder's config.json says the mode), then, if listed, `Normalize` (L2).
  Any other module (Dense, LayerNorm, ...) is refused: tpkit would compute something else.
- The pooling mode: `mean` (over the attention mask) or `cls` (the first token's hidden
  state); max, mean-sqrt-len, weighted mean, last token and combinations are refused.
- `sentence_bert_config.json`'s `max_seq_length`, where present, is the longest input
  (sentence-transformers truncates there; tpkit refuses longer inputs rather than
  answering something else).
- A folder without `modules.json` (a plain BERT folder, a tpkit checkpoint): mean
  pooling, not normalised, no length but the model's (what sentence-transformers builds
  for a plain Hugging Face model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tpkit.spec.errors import UserError

ST = "sentence_transformers.models."
MODES = ("mean", "cls")  # computed here; sentence-transformers' others are refused
_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
          "max": "pooling_mode_max_tokens", "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
          "weightedmean": "pooling_mode_weightedmean_tokens",
          "lasttoken": "pooling_mode_lasttoken"}


@dataclass(frozen=True)
class Pooling:
    """`mode` (mean or cls), `normalize` (L2 after pooling), `max_len` (the longest input
    the folder's sentence-transformers config takes; None: the model's)."""

    mode: str = "mean"
    normalize: bool = False
    max_len: int | None = None

    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Embeddings [b, h] (float32) of final hidden states [b, s, h] whose real tokens
        are where `mask` [b, s] is 1 (sentence-transformers' Pooling and Normalize)."""
        hidden = hidden.float()
        if self.mode == "cls":
            out = hidden[:, 0]
        else:
            m = mask.to(hidden.dtype).unsqueeze(-1)  # [b, s, 1]
            out = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(out, p=2, dim=1) if self.normalize else out

    def describe(self) -> str:
        """'mean pooling, L2-normalised' (for the server's first lines)."""
        return f"{self.mode} pooling" + (", L2-normalised" if self.normalize else "")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None


def read_pooling(folder: str | Path | None) -> Pooling:
    """The Pooling of a model folder's sentence-transformers files (none: mean, not
    normalised); UserError naming the file for a pipeline or mode tpkit does not compute."""
    root = Path(folder) if folder is not None else None
    if root is None or not (root / "modules.json").is_file():
        return Pooling()
    modules = _json(root / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UserError(f"{root / 'modules.json'}: not a list of modules")
    kinds = [str(m.get("type", "")).removeprefix(ST) for m in modules]
    other = [f"{m.get('type')} ({m.get('path')})" for m, k in zip(modules, kinds)
             if k not in ("Transformer", "Pooling", "Normalize")]
    if other:
        raise UserError(f"{root / 'modules.json'} lists {', '.join(other)}: tpkit computes "
                        f"only Transformer, Pooling ({' or '.join(MODES)}) and Normalize")
    mode = "mean"
    if "Pooling" in kinds:
        sub = modules[kinds.index("Pooling")].get("path") or "1_Pooling"
        mode = _mode(root / sub / "config.json") if (root / sub / "config.json").is_file() \
            else "mean"
    max_len = None
    if (root / "sentence_bert_config.json").is_file():
        max_len = _json(root / "sentence_bert_config.json").get("max_seq_length")
        if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
            raise UserError(f"{root / 'sentence_bert_config.json'}: max_seq_length="
                            f"{max_len!r} must be a positive integer")
    return Pooling(mode, "Normalize" in kinds, max_len)


def _mode(path: Path) -> str:
    config = _json(path)
    if isinstance(config.get("pooling_mode"), str):  # written by some versions
        modes = [config["pooling_mode"].removesuffix("_tokens").replace("_token", "")]
    else:
        modes = [m for m, flag in _FLAGS.items() if config.get(flag)]
    if len(modes) != 1 or modes[0] not in MODES:
        raise UserError(f"{path}: pooling {' + '.join(modes) or 'none'}; tpkit pools with "
                        f"one of {', '.join(MODES)}")
    return modes[0]
