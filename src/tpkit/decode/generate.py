"""Tensor-parallel text generation over the paged KV cache, one prompt or a batch: what
`model.generate(...)` of the Python API runs (`tpkit.load(path, mesh)` gives the model).
The commands `tpkit generate` and `tpkit serve` run on `tpkit.serve.Engine`, over the
same cache with a scheduler.

Each prompt gets its own blocks of a `PagedCache` (`tpkit.decode.paged_kv`), enough for
its prompt and every new token, taken once: each rank keeps the keys and values of
*its own* heads only, split over tp exactly like the qkv weights. A prompt is prefilled
alone, then every step decodes one token for all of them in one forward:

    prompt [s] --prefill, fills its blocks--> logits [V/tp] --all-gather--> [V]
    tokens [b] --decode at each prompt's own position--> [b, V/tp] --all-gather--> [b, V]
    -> the same token on every rank (same logits, same seed)

Two all-reduces per layer per forward (as in training) plus one all-gather of the last
logits. Prompts of different lengths need no padding (each has its own positions), so
each row generates what it would alone. `pad_left` still builds the left-padded batches
(ids + attention mask) that the full forward takes.

It shares with serve's `Engine` the forward (`paged_kv.forward`) and the sampler
(`sampling`), not the loop: this one runs alike on every rank (as `tpkit.spawn` calls
it), draws a batch's tokens from one generator seeded once and pads the rows that have
ended, where the engine's rank 0 alone schedules and samples (a generator per request)
and its followers replay its plans. Run on the engine, the Python API's seeded draws
would change.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tpkit.decode.paged_kv import PP_ERROR, PagedCache, Piece, forward
from tpkit.decode.sampling import sample, seeded
from tpkit.spec.errors import UserError

__all__ = ["PP_ERROR", "generate", "pad_left"]


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
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_id: int | list[int] | None = None, pad_id: int = 0,
             on_tokens: Callable[[list[int]], None] | None = None) -> torch.Tensor:
    """ids [b, s] -> [b, s + n]: greedy when temperature == 0, else sampled (top-k, top-p).

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
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]  # padding dropped
    cache = PagedCache(model)
    span = -(-(ids.shape[1] + max(max_new_tokens, 1)) // cache.block_size)  # blocks each
    cache.grow(1 + span * len(prompts))  # block 0 is the cache's scratch
    tables = [list(range(1 + i * span, 1 + (i + 1) * span)) for i in range(len(prompts))]
    gen = seeded(seed, ids.device)  # same draw on every rank
    done = torch.zeros(ids.shape[0], 1, dtype=torch.bool, device=ids.device)
    eos = None if eos_id is None or eos_id == [] else torch.tensor(eos_id, device=ids.device)
    lengths = [len(p) for p in prompts]  # tokens each has in the cache
    out, x = ids, ids[:, -1:]
    for step in range(max_new_tokens):
        if step == 0:  # [b, V]
            logits = torch.cat([forward(model, cache, [Piece(p, 0, t)])[0]
                                for p, t in zip(prompts, tables)])
        else:
            pieces = [Piece([tok], n, t) for tok, n, t in zip(x[:, 0].tolist(), lengths, tables)]
            logits = forward(model, cache, pieces)[0]  # [b, V]
            lengths = [n + 1 for n in lengths]
        x = sample(logits, temperature, top_k, top_p, gen).masked_fill(done, pad_id)  # [b, 1]
        out = torch.cat([out, x], dim=1)
        if on_tokens is not None:
            on_tokens(x[:, 0].tolist())
        if eos is not None:
            done = done | torch.isin(x, eos)
            if bool(done.all()):
                break
    return out
