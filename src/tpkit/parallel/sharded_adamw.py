"""AdamW on the dp shards of flat units (ZeRO-2 and FSDP): the state exists for 1/dp only.

Each unit's shard is one fp32 tensor laid out [decayed | undecayed] (`FlatUnit`); the
optimizer sees two views of it, one per param group, so weight decay applies to the
matrices only, as in `tpkit.train.optim.param_groups`, and every element gets the
very arithmetic of torch's AdamW on the unsharded model:

    group 0 (weight_decay):  unit0.shard[:d0]  unit1.shard[:d1] ...   grads: grad_shard views
    group 1 (0.0):           unit0.shard[d0:]  unit1.shard[d1:] ...

Checkpoints see the state per parameter, as plain AdamW keeps it (`full_state`,
`load_full_state`: one all-gather per unit and moment), so the file is the same with
or without sharding and at any dp (`tpkit.checkpoint.optim_state`).
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm import all_gather
from tpkit.comm.flat import unpack
from tpkit.parallel.flat_units import FlatUnit
from tpkit.parallel.shard_optim import OverShards

MOMENTS = ("exp_avg", "exp_avg_sq")


class ShardedAdamW(OverShards):
    """torch AdamW over the decayed / undecayed views of each unit's shard."""

    def __init__(self, units: list[FlatUnit], weight_decay: float, **adamw) -> None:
        self.units = units
        self.views: list[tuple[nn.Parameter | None, nn.Parameter | None]] = []
        decay, plain = [], []
        for u in units:
            d = nn.Parameter(u.shard[:u.decayed]) if u.decayed > 0 else None
            v = nn.Parameter(u.shard[u.decayed:]) if u.decayed < u.per else None
            self.views.append((d, v))
            decay += [d] if d is not None else []
            plain += [v] if v is not None else []
        model = ([p for u in units for p in u.params if p.dim() >= 2],  # as param_groups()
                 [p for u in units for p in u.params if p.dim() < 2])
        groups = [(dict(params=decay, weight_decay=weight_decay), model[0]),
                  (dict(params=plain, weight_decay=0.0), model[1])]
        kept = [(g, ps) for g, ps in groups if ps]
        self.params = [ps for _, ps in kept]  # the model parameters of each group (checkpoints)
        self.inner = torch.optim.AdamW([g for g, _ in kept], **adamw)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on every shard that received gradients (the views read the grad shard)."""
        for u, (d, v) in zip(self.units, self.views):
            g = u.grad_shard
            for view, part in ((d, slice(0, u.decayed)), (v, slice(u.decayed, u.per))):
                if view is not None:
                    view.grad = None if g is None else g[part]
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradient shards (and any full gradient left on a parameter)."""
        for u, views in zip(self.units, self.views):
            u.grad_shard = None
            for p in u.params:
                p.grad = None
            for view in views:
                if view is not None:
                    view.grad = None

    @torch.no_grad()
    def full_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Per-parameter AdamW state; call on every dp rank (all-gathers over dp)."""
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for u, views in zip(self.units, self.views):
            states = [self.inner.state.get(v, {}) for v in views if v is not None]
            if not any(states):
                continue
            step = next(s["step"] for s in states if s)
            for key in MOMENTS:
                local = torch.cat([s[key] for s in states])  # [n/dp]
                full = all_gather(local, u.group, dim=0, phase="checkpoint", scope="sharded")
                for p, piece in zip(u.params, unpack(full, u.params)):
                    out.setdefault(p, {"step": step.clone()})[key] = piece.clone()
        return out

    @torch.no_grad()
    def load_full_state(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Inverse of `full_state`: keep this rank's slice of each moment."""
        for u, views in zip(self.units, self.views):
            have = [state[p] for p in u.params if state.get(p)]
            for view in views:
                if view is not None:
                    self.inner.state.pop(view, None)
            if not have:
                continue
            step = next(e["step"] for e in have if "step" in e)
            for key in MOMENTS:
                flat = u.shard.new_zeros(u.padded)  # [n padded]
                offset = 0
                for p in u.params:
                    if key in state.get(p, {}):
                        flat[offset:offset + p.numel()] = state[p][key].reshape(-1)
                    offset += p.numel()
                mine = flat[u.lo:u.lo + u.per]
                for view, part in ((views[0], slice(0, u.decayed)),
                                   (views[1], slice(u.decayed, u.per))):
                    if view is not None:
                        entry = self.inner.state.setdefault(view, {"step": step.clone().float()})
                        entry[key] = mine[part].clone()
