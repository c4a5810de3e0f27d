"""Rotary position embeddings (Su et al. 2021), in the rotate-half layout of Llama.

Applied per head, so it commutes with splitting heads over tp: each rank rotates
its own heads with the same angles.
"""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=32)
def _table(n: int, head_dim: int, theta: float, device: torch.device | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                          / head_dim)  # [hd/2]
    pos = torch.arange(n, device=device, dtype=torch.float32)  # [n]
    freqs = torch.outer(pos, inv)  # [n, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [n, hd]
    return emb.cos(), emb.sin()


def rope_angles(seq: int, head_dim: int, theta: float, offset: int = 0,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [seq, head_dim] for positions offset .. offset+seq-1 (cached tables)."""
    n = 1 << max(offset + seq - 1, 1).bit_length()  # a power of two >= offset + seq
    cos, sin = _table(n, head_dim, float(theta), device)
    return cos[offset:offset + seq], sin[offset:offset + seq]


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
