"""`tpkit generate`: tensor-parallel text generation with a KV cache.

    tpkit generate --checkpoint runs/demo/ckpt/step-200 --tp 2 --prompt "Tensor"

Each rank keeps the keys and values of *its own* heads only ([b, kv_local, t, hd]
per layer, `KVCache`): the cache is split over tp exactly like the qkv weights, so
tp ranks hold 1/tp of it each (GQA kv heads shared when num_kv_heads < tp).

    prompt [b, s] --forward, fills caches--> logits [b, s, V/tp] --last position-->
    all-gather over tp -> [b, V] -> same token on every rank (same logits, same seed)
    token [b, 1] --forward at position_offset = t, appends to caches--> ...

Two all-reduces per layer per token (as in training) plus one all-gather of the last
logits. tpkit checkpoints use a byte-level tokenizer (ids 0..255 are UTF-8 bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm import all_gather
from tpkit.layers.attention import KVCache
from tpkit.spec.errors import UserError


@torch.no_grad()
def generate(model: nn.Module, ids: torch.Tensor, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
             eos_id: int | None = None) -> torch.Tensor:
    """ids [b, s] -> [b, s + n]: greedy when temperature == 0, else sampled (top-k).

    Call on every tp rank of a pp=1 model; every rank returns the same tokens.
    """
    if not (model.is_first_stage and model.is_last_stage):
        raise UserError("generate needs pp=1 (every stage's layers on each rank)")
    if ids.shape[1] + max_new_tokens > model.config.max_seq_len:
        raise UserError(f"prompt {ids.shape[1]} + {max_new_tokens} new tokens exceeds "
                         f"max_seq_len={model.config.max_seq_len}")
    model.eval()
    caches = [KVCache() for _ in model.layers]
    gen = torch.Generator(device=ids.device).manual_seed(seed)  # same draw on every rank
    out, x, offset = ids, ids, 0
    for _ in range(max_new_tokens):
        logits = model(x, kv_caches=caches, position_offset=offset)  # [b, s, V_pad/tp]
        offset += x.shape[1]
        last = all_gather(logits[:, -1], model.group, dim=-1)  # [b, V_pad]
        x = pick(last[:, :model.config.vocab_size], temperature, top_k, gen)  # [b, 1]
        out = torch.cat([out, x], dim=1)
        if eos_id is not None and bool((x == eos_id).all()):
            break
    return out


def pick(logits: torch.Tensor, temperature: float, top_k: int | None,
         gen: torch.Generator) -> torch.Tensor:
    """Next token [b, 1] from full logits [b, V]."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen)


def encode(text: str) -> list[int]:
    """Byte-level tokenizer of tpkit checkpoints: UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    """Inverse of `encode` (ids >= 256 are dropped; bad UTF-8 replaced)."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
