"""A draft model for `--speculative draft`: a Hugging Face Llama folder (SmolLM2-135M's,
benchmarks/smollm2_folder.py) cut to its first N decoder layers, its final norm and
head kept (early-exit self-speculation: the same tokenizer, a fraction of the reads).

    .venv/bin/python benchmarks/smollm2_draft.py CACHE/smollm2-hf --layers 8 \\
        --out CACHE/smollm2-draft8

The folder is a benchmark input: keep it outside the repository.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def cut(src: Path, out: Path, layers: int) -> None:
    """Write `src`'s first `layers` layers (and everything not in a layer) to `out`."""
    config = json.loads((src / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise SystemExit(f"smollm2_draft: --layers={layers} must be in [1, "
                         f"{config['num_hidden_layers'] - 1}]")
    out.mkdir(parents=True, exist_ok=True)
    weights = load_file(src / "model.safetensors")
    keep = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, out / f.name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="the Hugging Face folder (model.safetensors)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    cut(args.src, args.out, args.layers)
    print(f"wrote {args.out} ({args.layers} layers)")


if __name__ == "__main__":
    main()
