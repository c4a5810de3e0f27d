"""The next token from full logits: greedy, or sampled with temperature, top-k, top-p.

    token = sample(logits, temperature=0.8, top_k=50, top_p=0.95, generator=g)

Greedy (temperature 0, or below `GREEDY_BELOW`) is the argmax: sampling tends to it as
the temperature goes to 0, and logits / 1e-300 overflow float32 into inf - inf = nan,
which no draw survives (vLLM takes the same 1e-5 bound). Otherwise the logits are divided by the
temperature, cut to the k largest (top-k) and to the smallest set of tokens whose
probability reaches p (top-p, nucleus), and one token is drawn with `generator` (one
per request: its seed alone decides the draw, whatever else is being generated).

`seeded(seed, device)` makes that generator from all 64 bits of a seed: torch's CPU
generator (MT19937) seeds from the low 32 bits only, so seeds 7 and 7 + 2**40 drew
the same tokens. A seed in [0, 2**32) seeds it as `manual_seed` does (the same draws
as before); any other (negative: modulo 2**64) fills its 624 words from both halves,
as MT19937's `init_by_array` does (numpy's `RandomState` for a 64-bit seed). A CUDA
generator (Philox) takes the 64 bits as they are.
"""

from __future__ import annotations

import threading
from functools import cache

import numpy as np
import torch

GREEDY_BELOW = 1e-5  # a temperature under this is greedy
TOP_P_MIN = 2.0 ** -149  # float32's smallest positive (~1.4e-45): a top_p below is 0 there
_WORDS, _AT = 624, 24  # MT19937's state words, and where torch's CPU state holds them
_LOCAL = threading.local()


def seeded(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` whose draws depend on all 64 bits of `seed` (an integer
    in [-2**63, 2**64), as `manual_seed` takes; an OverflowError outside)."""
    if not -(1 << 63) <= seed < 1 << 64:
        raise OverflowError(f"seed {seed} is not a 64-bit integer")
    g = torch.Generator(device)
    u = seed % (1 << 64)
    if g.device.type != "cpu" or u < 1 << 32:
        return g.manual_seed(u)
    if not hasattr(_LOCAL, "mt"):  # one per thread, seeded again each time (cheaper)
        _LOCAL.mt = np.random.RandomState()
    _LOCAL.mt.seed(np.array([u & 0xFFFFFFFF, u >> 32], np.uint32))
    words = _LOCAL.mt.get_state(legacy=True)[1].astype(np.uint64)
    state = _cpu_state_template().copy()
    state[:8] = np.frombuffer(np.uint64(u).tobytes(), np.uint8)  # its initial_seed()
    state[_AT:_AT + 8 * _WORDS] = np.frombuffer(words.tobytes(), np.uint8)
    g.set_state(torch.from_numpy(state))
    return g


@cache
def _cpu_state_template() -> np.ndarray:
    """The bytes of a freshly seeded CPU generator, its state words checked to lie where
    `seeded` writes them (a torch that moved them fails here, not silently)."""
    state = torch.Generator().manual_seed(1).get_state().numpy().copy()
    words = np.frombuffer(state[_AT:_AT + 8 * _WORDS].tobytes(), np.uint64)
    if not (words == np.random.RandomState(1).get_state()[1]).all():
        raise RuntimeError("torch's CPU generator state is not laid out as tpkit expects")
    return state


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
        drop = before >= top_p
        drop[..., 0] = False  # the best token always stays (a top_p below float32's least
        # positive value is 0 here, and 0 >= 0 would drop every token)
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
