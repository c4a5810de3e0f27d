"""ZeRO stage 1: AdamW whose state (exp_avg, exp_avg_sq) is sharded over dp.

Rajbhandari et al. 2020, "P_os". Every dp replica holds the full parameters and,
after the dp all-reduce, the full averaged gradients; each one updates only its
1/dp slice of the flattened parameters, then the slices are all-gathered:

    flat params [ r0 | r1 | ... | r(dp-1) ]      (padded to a multiple of dp)
    rank r:  AdamW on slice r (state for slice r only: 2/dp of the fp32 moments)
    all_gather(dp) -> every replica has the whole updated flat vector -> params

The moments take 1/dp of the memory. The update is element-wise, so the result is
AdamW's, exactly. (With a reduce-scatter of the gradients instead of the all-reduce
it would be ZeRO-2; the bytes on the wire are the same.)
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm import all_gather
from tpkit.comm.group import CommGroup


class ZeroAdamW:
    """AdamW over param groups, its state sharded over a dp group."""

    def __init__(self, param_groups: list[dict], group: CommGroup, **adamw) -> None:
        self.group = group
        self.params = [list(g["params"]) for g in param_groups]
        shards = []
        for g, params in zip(param_groups, self.params):
            lo, hi, _ = self._bounds(params)
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            master = nn.Parameter(_padded(flat, self._padded_len(params))[lo:hi].clone())
            shards.append({**{k: v for k, v in g.items() if k != "params"}, "params": [master]})
        self.inner = torch.optim.AdamW(shards, **adamw)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (set `lr` here)."""
        return self.inner.param_groups

    def _padded_len(self, params: list[nn.Parameter]) -> int:
        n = sum(p.numel() for p in params)
        return -(-n // self.group.size) * self.group.size

    def _bounds(self, params: list[nn.Parameter]) -> tuple[int, int, int]:
        n = self._padded_len(params) // self.group.size
        return self.group.rank * n, (self.group.rank + 1) * n, n

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's slice, then all-gather the slices into every parameter."""
        for params, shard_group in zip(self.params, self.inner.param_groups):
            lo, hi, _ = self._bounds(params)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat_g = _padded(torch.cat([g.reshape(-1) for g in grads]), self._padded_len(params))
            shard_group["params"][0].grad = flat_g[lo:hi].clone()  # [n/dp]
        self.inner.step()
        for params, shard_group in zip(self.params, self.inner.param_groups):
            mine = shard_group["params"][0].detach()  # [n/dp]
            flat = all_gather(mine, self.group, dim=0, phase="grads", scope="zero1")  # [n]
            offset = 0
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of the model parameters."""
        for params in self.params:
            for p in params:
                p.grad = None

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a shard saved by `state_dict` (same dp layout)."""
        self.inner.load_state_dict(state)


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([flat, flat.new_zeros(n - flat.numel())]) if n > flat.numel() else flat
