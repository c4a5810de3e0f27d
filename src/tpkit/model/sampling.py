"""The next token from full logits: greedy, or sampled with temperature, top-k, top-p.

    token = sample(logits, temperature=0.8, top_k=50, top_p=0.95, generator=g)

Greedy (temperature 0, or below `GREEDY_BELOW`) is the argmax: sampling tends to it as
the temperature goes to 0, and logits / 1e-300 overflow float32 into inf - inf = nan,
which no draw survives (vLLM takes the same 1e-5 bound). Otherwise the logits are divided by the
temperature, cut to the k largest (top-k) and to the smallest set of tokens whose
probability reaches p (top-p, nucleus), and one token is drawn with `generator` (one
per request: its seed alone decides the draw, whatever else is being generated).
"""

from __future__ import annotations

import torch

GREEDY_BELOW = 1e-5  # a temperature under this is greedy
TOP_P_MIN = 2.0 ** -149  # float32's smallest positive (~1.4e-45): a top_p below is 0 there


def filtered(logits: torch.Tensor, temperature: float, top_k: int | None = None,
             top_p: float | None = None) -> torch.Tensor:
    """logits [..., V] -> float32 logits / temperature, -inf outside top-k and top-p."""
    x = logits.float() / temperature
    if top_k:
        kth = x.topk(min(top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        srt, order = x.sort(dim=-1, descending=True)
        before = srt.softmax(-1).cumsum(-1) - srt.softmax(-1)  # mass of the better tokens
        drop = before >= top_p  # the best token always stays (before = 0)
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None
           ) -> torch.Tensor:
    """Next token(s) [..., 1] from logits [..., V] (a batch draws one per row)."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1, keepdim=True)
    probs = filtered(logits, temperature, top_k, top_p).softmax(-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(*probs.shape[:-1], 1)
