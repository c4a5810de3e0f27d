"""Rotary position embeddings (Su et al. 2021), in the rotate-half layout of Llama.

Applied per head, so it commutes with splitting heads over tp: each rank rotates
its own heads with the same angles.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def llama3_scaled(inv: torch.Tensor, factor: float, low: float, high: float, context: int
                  ) -> torch.Tensor:
    """Llama 3.1's frequencies: wavelengths longer than context/low are slowed down by
    `factor`, shorter than context/high kept, the band between interpolated."""
    wavelen = 2 * math.pi / inv  # [hd/2]
    slowed = torch.where(wavelen > context / low, inv / factor, inv)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, slowed)


@lru_cache(maxsize=32)
def _table(n: int, head_dim: int, theta: float, device: torch.device | None,
           llama3: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                          / head_dim)  # [hd/2]
    if llama3 is not None:
        inv = llama3_scaled(inv, *llama3)
    pos = torch.arange(n, device=device, dtype=torch.float32)  # [n]
    freqs = torch.outer(pos, inv)  # [n, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [n, hd]
    return emb.cos(), emb.sin()


def rope_angles(seq: int, head_dim: int, theta: float, offset: int = 0,
                device: torch.device | None = None, llama3: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [seq, head_dim] for positions offset .. offset+seq-1 (cached tables);
    `llama3`: (factor, low_freq_factor, high_freq_factor, original context) scaling."""
    n = 1 << max(offset + seq - 1, 1).bit_length()  # a power of two >= offset + seq
    cos, sin = _table(n, head_dim, float(theta), device, llama3)
    return cos[offset:offset + seq], sin[offset:offset + seq]


def rope_at(positions: torch.Tensor, head_dim: int, theta: float, max_len: int,
            llama3: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [b, 1, s, head_dim] for each row's own positions [b, s] (< max_len), read
    from one table of a size fixed by `max_len`: a position's angles never depend on
    which other rows or positions share the batch."""
    cos, sin = rope_table(head_dim, theta, max_len, positions.device, llama3)
    return cos[positions][:, None], sin[positions][:, None]


def rope_table(head_dim: int, theta: float, max_len: int, device=None,
               llama3: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The table `rope_at` reads: cos, sin [n, head_dim] (contiguous float32, cached) of
    positions 0 .. n-1, n the power of two >= max_len."""
    n = 1 << max(max_len - 1, 1).bit_length()
    return _table(n, head_dim, float(theta), device, llama3)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, hd] rotated by position; with cos/sin narrower than hd (partial
    rotary, GPT-NeoX) only the first dims rotate and the rest pass through."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    return (x.float() * cos + _rotate_half(x.float()) * sin).to(x.dtype)
