"""LoRA adapters out of tpkit, from any source of full logical tensors (a checkpoint of
`tpkit train --lora-rank`): PEFT's adapter folder, or the model with them folded in.

    write_peft(src, out)    adapter_config.json + adapter_model.safetensors, PEFT's names:
                            base_model.model.<HF module>.lora_A.weight [r, in], lora_B [out, r]
    merged_source(src)      every base tensor, W + (alpha / r) B A where adapted; the
                            config without LoRA (`write_hf` exports it)

tpkit holds one A and B per projection even where it fuses them (qkv, gate+up): each
goes to the Hugging Face tensor its rows came from (the family's recipe). A family
whose Hugging Face checkpoint fuses them too (Phi-3's qkv_proj, GPT-NeoX's
query_key_value, GPT-2's transposed c_attn) has no PEFT module per projection: refused
in one line, --to hf --merge writes it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tpkit.layers.lora import layer_parts, merged
from tpkit.model.names import layer
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import UserError
from tpkit.weights.families import of_config, with_family
from tpkit.weights.hf import MARK
from tpkit.weights.slices import DictSource

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def adapted(c: ModelConfig):
    """(base weight, part index, its row offset, rows, target, A name, B name) of every
    adapter of a model `c`, layer by layer."""
    for i in range(c.num_layers):
        for path, parts in layer_parts(c).items():
            at = 0
            for j, (target, rows) in enumerate(parts):
                if target in c.lora_targets:
                    mod = f"{layer(i)}.{path}"
                    yield (f"{mod}.weight", j, at, rows, target, f"{mod}.lora.A.{target}",
                           f"{mod}.lora.B.{target}")
                at += rows


def _has_adapters(src: Any, what: str) -> ModelConfig:
    c = src.config
    if not c.lora_rank:
        raise UserError(f"{src.where}: holds no LoRA adapters (a run of tpkit train "
                        f"--lora-rank has them): nothing to {what}")
    return c


def _full(src: Any, name: str) -> torch.Tensor:
    shape = src.logical_shape(name)
    return src.read(name, 0, 0, shape[0]) if shape else src.read(name, 0, 0, 1)


def peft_module(c: ModelConfig, base: str, part: int) -> str:
    """The Hugging Face module (below the whole model) of part `part` of tpkit's `base`."""
    fam = of_config(c)
    recipe = fam.table(c)[base]
    cuts = recipe.cuts
    parts = layer_parts(c)[base.split(".", 2)[2].removesuffix(".weight")]
    fused = recipe.transposed or len(cuts) != len(parts) or cuts[part].start != 0
    if fused:
        raise UserError(f"{fam.name}: {base} is one fused Hugging Face tensor "
                        f"({cuts[0].key}): PEFT has no module per projection there; "
                        f"--to hf --merge writes the model with the adapters folded in")
    key = cuts[part].key.removesuffix(".weight")
    return key[1:] if key.startswith("@") else fam.prefixes[0] + key


def write_peft(src: Any, out_dir: str | Path) -> Path:
    """PEFT's adapter folder of the adapters of `src` (an open source)."""
    c = with_family(_has_adapters(src, "export"))
    tensors, modules = {}, set()
    for base, part, _, _, _, a, b in adapted(c):
        module = peft_module(c, base, part)
        modules.add(module.rsplit(".", 1)[-1])
        tensors[f"base_model.model.{module}.lora_A.weight"] = _full(src, a).contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = _full(src, b).contiguous()
    alpha = int(c.lora_alpha) if float(c.lora_alpha).is_integer() else c.lora_alpha
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=c.lora_rank, lora_alpha=alpha,
                  lora_dropout=0.0, target_modules=sorted(modules), bias="none",
                  fan_in_fan_out=False, inference_mode=True, use_rslora=False,
                  base_model_name_or_path=None, modules_to_save=None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt", MARK[0]: MARK[1]})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    return out


def merged_source(src: Any) -> DictSource:
    """Every base tensor of `src` with its adapters folded in (W + s B A), as a source of
    the model without LoRA."""
    c = _has_adapters(src, "merge")
    adapters = {n for *_, a, b in adapted(c) for n in (a, b)}
    full = {n: _full(src, n).clone() for n in sorted(src.names) if n not in adapters}
    scale = c.lora_alpha / c.lora_rank
    for base, _, at, rows, _, a, b in adapted(c):
        w = full[base]
        w[at:at + rows] = merged(w[at:at + rows], _full(src, a), _full(src, b), scale)
    plain = replace(c, lora_rank=0, lora_alpha=0.0, lora_targets=())
    return DictSource(full, plain, where=src.where)
