"""JSON with tensors in it: what a checkpoint's `extra` and optimizer settings hold.

    encode({"pos": 3, "state": tensor}) -> {"pos": 3, "state": {"__tensor__": base64, ...}}
    decode(encode(x)) == x              # dtype, shape and bytes exactly

No pickle: a tensor is its raw bytes in base64 with its dtype and shape.
"""

from __future__ import annotations

import base64
from typing import Any

import torch


def encode(obj: Any) -> Any:
    """JSON form of nested dicts/lists with tensors (base64 of the raw bytes)."""
    if torch.is_tensor(obj):
        t = obj.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": base64.b64encode(raw).decode(), "dtype": str(t.dtype)[6:],
                "shape": list(t.shape)}
    if isinstance(obj, dict):
        return {str(k): encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"checkpoint extra: cannot store a {type(obj).__name__} (use JSON values "
                    f"and tensors)")


def decode(obj: Any) -> Any:
    """Inverse of `encode`."""
    if isinstance(obj, dict) and "__tensor__" in obj:
        raw = bytearray(base64.b64decode(obj["__tensor__"]))
        dtype = getattr(torch, obj["dtype"])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(obj["shape"]).clone()
    if isinstance(obj, dict):
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj
