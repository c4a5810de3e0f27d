"""Tensor-parallel text generation with a KV cache, one prompt or a batch of them.

    tpkit generate --checkpoint runs/demo/checkpoints/step_000200 --tp 2 --prompt "Tensor"

Each rank keeps the keys and values of *its own* heads only ([b, kv_local, t, hd]
per layer, `KVCache`): the cache is split over tp exactly like the qkv weights, so
tp ranks hold 1/tp of it each (GQA kv heads shared when num_kv_heads < tp).

    prompt [b, s] --forward, fills caches--> logits [b, s, V/tp] --last position-->
    all-gather over tp -> [b, V] -> same token on every rank (same logits, same seed)
    token [b, 1] --forward at position_offset = t, appends to caches--> ...

Two all-reduces per layer per token (as in training) plus one all-gather of the last
logits.

Prompts of different lengths are left-padded (`pad_left`) into one batch, with an
attention mask [b, t] (0 on the padding) that keeps every row from reading its pads:

    row 0:  [pad pad  p0  p1  p2] g0 g1 ...    positions  -  -  0  1  2  3  4
    row 1:  [ q0  q1  q2  q3  q4] h0 h1 ...    positions  0  1  2  3  4  5  6

Learned positions get each row's own (`position_offset` [b] = t - pads); rotary
attention depends only on the distance between positions, which the same shift
of a whole row leaves unchanged. So each row generates what it would alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tpkit.comm import all_gather
from tpkit.layers.attention import KVCache
from tpkit.spec.errors import UserError

PP_ERROR = ("generate runs at pp=1: one sequence's tokens come one at a time, so a "
            "pipeline would keep all but one stage idle; every tpkit checkpoint loads at "
            "pp=1 (split the model's memory with tp instead)")


def pad_left(prompts: list[list[int]], pad_id: int = 0, device=None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of any lengths -> (ids [b, s], attention mask [b, s]), padded on the left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError(f"every prompt needs at least one token (lengths "
                        f"{[len(p) for p in prompts]})")
    s = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (s - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (s - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask  # [b, s] each


@torch.no_grad()
def generate(model: nn.Module, ids: torch.Tensor, max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, eos_id: int | list[int] | None = None,
             pad_id: int = 0, on_tokens: Callable[[list[int]], None] | None = None
             ) -> torch.Tensor:
    """ids [b, s] -> [b, s + n]: greedy when temperature == 0, else sampled (top-k).

    `attention_mask` [b, s]: 1 on tokens, 0 on left padding (see `pad_left`). A row that
    has produced `eos_id` (or one of a list) continues with `pad_id` until every row has
    (then it stops), as transformers' generate does.
    `on_tokens` gets each step's new tokens (one per row), as they arrive.
    Call on every tp rank of a pp=1 model; every rank returns the same tokens.
    """
    if not (model.is_first_stage and model.is_last_stage):
        raise UserError(PP_ERROR)
    if ids.shape[1] + max_new_tokens > model.config.max_seq_len:
        raise UserError(f"prompt {ids.shape[1]} + {max_new_tokens} new tokens exceeds "
                         f"max_seq_len={model.config.max_seq_len}")
    model.eval()
    caches = [KVCache() for _ in model.layers]
    gen = torch.Generator(device=ids.device).manual_seed(seed)  # same draw on every rank
    mask = attention_mask
    pads = None if mask is None else ids.shape[1] - mask.sum(1)  # [b] left padding per row
    done = torch.zeros(ids.shape[0], 1, dtype=torch.bool, device=ids.device)
    eos = None if eos_id is None or eos_id == [] else torch.tensor(eos_id, device=ids.device)
    out, x, offset = ids, ids, 0
    for _ in range(max_new_tokens):
        where = offset if pads is None else offset - pads  # [b]: each row's own positions
        logits = model(x, attention_mask=mask, kv_caches=caches,
                       position_offset=where)  # [b, s, V_pad/tp]
        offset += x.shape[1]
        last = all_gather(logits[:, -1], model.group, dim=-1)  # [b, V_pad]
        x = pick(last[:, :model.config.vocab_size], temperature, top_k, gen)  # [b, 1]
        x = x.masked_fill(done, pad_id)
        out = torch.cat([out, x], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(x)], dim=1)  # [b, t + 1]
        if on_tokens is not None:
            on_tokens(x[:, 0].tolist())
        if eos is not None:
            done = done | torch.isin(x, eos)
            if bool(done.all()):
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

