"""ZeRO stage 1: AdamW whose state (exp_avg, exp_avg_sq) is sharded over dp.

Rajbhandari et al. 2020, "P_os"; Megatron-LM's distributed optimizer. Every dp
replica holds the full parameters; each one updates only its 1/dp slice of the
flattened parameters, so it needs only that slice of the averaged gradients:

    flat grads  [ r0 | r1 | ... | r(dp-1) ]      (padded to a multiple of dp)
    reduce_scatter(dp) / dp -> rank r has the averaged slice r       (n (p-1)/p out)
    rank r:  AdamW on slice r (state for slice r only: 2/dp of the fp32 moments)
    all_gather(dp) -> every replica has the whole updated flat vector  (n (p-1)/p out)

A ring all-reduce is exactly a reduce-scatter followed by an all-gather, so the
step moves the bytes of the plain data-parallel all-reduce, 2 n (p-1)/p per rank
(`tpkit.spec.theory.data_parallel`), not 1.5x that as an all-reduce of the
gradients followed by the all-gather would. The moments take 1/dp of the memory;
the update is element-wise, so the result is AdamW's, exactly.

In the training loop the gradients are reduce-scattered (`reduce_gradients`) after
the tensor- and pipeline-parallel gradient sums and before the gradient norm: each
rank's `.grad` then holds its averaged slice and zeros elsewhere, so the norm is
the sum of the ranks' shares over dp (`global_grad_norm(..., dp_sharded=True)`).
Called alone, `step` reduce-scatters first (averaging gradients that are already
averaged changes nothing).

Checkpoints see the state per parameter, as plain AdamW keeps it (`full_state`:
all-gather the slices over dp, cut the flat vector back into parameters;
`load_full_state`: flatten, keep slice r), so a file does not depend on dp or on
ZeRO being on.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm import all_gather, reduce_scatter
from tpkit.comm.flat import pack, unpack, unpack_into
from tpkit.comm.group import CommGroup
from tpkit.parallel.shard_optim import OverShards


class ZeroAdamW(OverShards):
    """AdamW over param groups, its state sharded over a dp group (ZeRO-1). A
    `replicated.StepOptimizer`: it reduce-scatters the gradients itself."""

    dp_sharded = True

    def __init__(self, param_groups: list[dict], group: CommGroup, **adamw) -> None:
        self.group = group
        self.params = [list(g["params"]) for g in param_groups]
        shards = []  # one slice per group: filled for the update only (see `step`)
        for g, params in zip(param_groups, self.params):
            master = nn.Parameter(params[0].detach().new_empty(0))
            shards.append({**{k: v for k, v in g.items() if k != "params"}, "params": [master]})
        self.inner = torch.optim.AdamW(shards, **adamw)
        self._reduced = False

    def _padded_len(self, params: list[nn.Parameter]) -> int:
        n = sum(p.numel() for p in params)
        return -(-n // self.group.size) * self.group.size

    def _bounds(self, params: list[nn.Parameter]) -> tuple[int, int, int]:
        n = self._padded_len(params) // self.group.size
        return self.group.rank * n, (self.group.rank + 1) * n, n

    def _flat(self, tensors: list[torch.Tensor], params: list[nn.Parameter]) -> torch.Tensor:
        """This rank's slice [n/dp] of the padded concatenation of `tensors`."""
        lo, hi, _ = self._bounds(params)
        flat = pack(tensors)  # [n]
        return _padded(flat, self._padded_len(params))[lo:hi]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the gradients over dp: each `.grad` keeps this rank's averaged
        slice and is zero outside it (one reduce-scatter of n padded elements per group)."""
        for params in self.params:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = _padded(torch.cat([g.reshape(-1) for g in grads]),
                           self._padded_len(params))  # [n]
            mine = reduce_scatter(flat, self.group, dim=0, phase="grads", scope="zero1")
            lo, hi, _ = self._bounds(params)
            flat.zero_()[lo:hi] = mine / self.group.size  # [n], averaged slice r only
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        self._reduced = True

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's slice, then all-gather the slices into every parameter.

        The slice is read from the parameters for the update and released after it: the
        parameters are the weights (fp32 ones, or `train.master`'s fp32 masters of a bf16
        model), so a copy kept between steps would be a second copy of 1/dp of them.
        """
        if not self._reduced:
            self.reduce_gradients()
        for params, shard_group in zip(self.params, self.inner.param_groups):
            master = shard_group["params"][0]
            master.data = self._flat([p.detach() for p in params], params).clone()  # [n/dp]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            master.grad = self._flat(grads, params).clone()  # [n/dp]
        self.inner.step()
        self._reduced = False
        for params, shard_group in zip(self.params, self.inner.param_groups):
            master = shard_group["params"][0]
            flat = all_gather(master.detach(), self.group, dim=0, phase="grads",
                              scope="zero1")  # [n]
            unpack_into(flat, params)
            master.data, master.grad = master.data.new_empty(0), None  # until the next step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of the model parameters."""
        for params in self.params:
            for p in params:
                p.grad = None

    @torch.no_grad()
    def full_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Per-parameter AdamW state, as `torch.optim.AdamW.state` holds it; call on every
        dp rank (one all-gather per group and moment)."""
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for params, shard_group in zip(self.params, self.inner.param_groups):
            state = self.inner.state.get(shard_group["params"][0], {})
            moments = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1}
            full = {k: all_gather(v, self.group, dim=0, phase="checkpoint", scope="zero1")
                    for k, v in moments.items()}  # [n padded]
            pieces = {k: unpack(v, params) for k, v in full.items()}
            for i, p in enumerate(params):
                entry = {k: v.clone() for k, v in state.items() if k not in moments}  # step
                entry.update({k: v[i].clone() for k, v in pieces.items()})
                if entry:
                    out[p] = entry
        return out

    @torch.no_grad()
    def load_full_state(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Inverse of `full_state`: keep this rank's slice of each moment (a parameter
        without state gets zeros; the step count is the group's)."""
        for params, shard_group in zip(self.params, self.inner.param_groups):
            master = shard_group["params"][0]
            have = [state[p] for p in params if state.get(p)]
            if not have:
                self.inner.state.pop(master, None)
                continue
            entry = {k: v.clone() for k, v in have[0].items() if v.dim() == 0}  # step
            for key in {k for e in have for k, v in e.items() if v.dim() > 0}:
                parts = [state[p][key] if key in state.get(p, {}) else torch.zeros_like(p)
                         for p in params]
                entry[key] = self._flat([t.to(master) for t in parts], params).clone()
            self.inner.state[master] = entry


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([flat, flat.new_zeros(n - flat.numel())]) if n > flat.numel() else flat
