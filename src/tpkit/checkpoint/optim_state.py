"""Optimizer state in checkpoints: per parameter, tagged like the parameter, any layout.

On disk the state of AdamW is what `torch.optim.AdamW.state` holds, per parameter:

    "{param}::exp_avg", "{param}::exp_avg_sq"   same shape and split tag as the parameter
    "{param}::step"                             a scalar, replicated

ZeRO-1 (`ZeroAdamW`) keeps the moments as flat per-dp slices instead. They are
gathered over dp and cut back into parameters before a save, and re-sliced after a
load, so the file is the same with or without ZeRO and at any dp:

    save:  slice r [n/dp] --all_gather(dp)--> flat [n] --cut--> exp_avg of each param
    load:  exp_avg of each param (resharded over tp by its tag) --flatten--> keep slice r
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.layers.sharding import split_of
from tpkit.mesh import ParallelMesh
from tpkit.spec.errors import CheckpointError
from tpkit.weights.files import MANIFEST, ShardedSource
from tpkit.weights.slices import read_local, state_name

State = dict[nn.Parameter, dict[str, torch.Tensor]]


def _sharded(optimizer) -> bool:
    """A dp-sharded optimizer (ZeRO-1 `ZeroAdamW`, ZeRO-2 / FSDP `ShardedAdamW`): its state
    comes per parameter from `full_state` and goes back through `load_full_state`."""
    return hasattr(optimizer, "full_state") and hasattr(optimizer, "load_full_state")


def keys_by_param(saved: dict) -> dict[str, list[str]]:
    """Parameter name -> the keys of its saved state ("exp_avg", "step"...), from the
    manifest's optim_tensors."""
    keys: dict[str, list[str]] = {}
    for full in saved:
        name, key = full.split("::", 1)
        keys.setdefault(name, []).append(key)
    return keys


def gather_state(optimizer) -> State:
    """Per-parameter state of a torch optimizer or a `ZeroAdamW` (then a collective over
    its dp group: call on every rank)."""
    if _sharded(optimizer):
        return optimizer.full_state()
    return {p: {k: v if torch.is_tensor(v) else torch.tensor(v) for k, v in s.items()}
            for p, s in optimizer.state.items()}


def state_tensors(own: dict[str, nn.Parameter], state: State) -> dict:
    """"{param}::{key}" -> (tensor, split: the parameter's, or None for scalars), for the
    parameters this stage owns (`own`: name -> parameter)."""
    names = {id(p): n for n, p in own.items()}
    return {state_name(names[id(p)], key): (value, split_of(p) if value.shape == p.shape else None)
            for p, entry in state.items() if id(p) in names for key, value in entry.items()}


def group_settings(optimizer) -> list[dict]:
    """Hyper-parameters of each param group (lr, betas, weight decay...), no parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def model_groups(optimizer) -> list[list[nn.Parameter]]:
    """The model parameters of each group (ZeRO-1: not its flat slices)."""
    if _sharded(optimizer):
        return optimizer.params
    return [list(g["params"]) for g in optimizer.param_groups]


def stage_state(weights: ShardedSource, model: nn.Module, optimizer,
                mesh: ParallelMesh) -> State:
    """Read this rank's slices of the saved state of every parameter of `optimizer`
    (`weights`: the open checkpoint; its optimizer files are read)."""
    root, manifest = weights.root, weights.manifest
    if manifest.get("optimizer") is None:
        raise CheckpointError(f"{root / MANIFEST}: the checkpoint holds no optimizer state")
    keys = keys_by_param(manifest["optim_tensors"])
    staged = read_local(model, ShardedSource(root, manifest, "optim"), mesh, state_keys=keys)
    names = {id(p): n for n, p in model.named_parameters()}
    state: State = {}
    for p in (p for params in model_groups(optimizer) for p in params):
        prefix = state_name(names[id(p)], "")
        entry = {k.removeprefix(prefix): v for k, v in staged.items() if k.startswith(prefix)}
        if entry:
            state[p] = entry
    groups = manifest["optimizer"]["groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{root / MANIFEST}: {len(groups)} optimizer parameter groups "
                              f"saved, the optimizer has {len(optimizer.param_groups)}")
    return state


def apply_state(optimizer, state: State, groups: list[dict]) -> None:
    """Put staged per-parameter `state` and the saved group settings into `optimizer`."""
    if _sharded(optimizer):
        for mine, old in zip(optimizer.param_groups, groups):
            mine.update({k: tuple(v) if isinstance(mine.get(k), tuple) else v
                         for k, v in old.items()})
        optimizer.load_full_state(state)
        return
    state_dict = optimizer.state_dict()
    order = [p for g in optimizer.param_groups for p in g["params"]]
    for mine, old in zip(state_dict["param_groups"], groups):
        mine.update({k: tuple(v) if isinstance(mine.get(k), tuple) else v
                     for k, v in old.items()})
    state_dict["state"] = {i: state[p] for i, p in enumerate(order) if p in state}
    optimizer.load_state_dict(state_dict)
