"""Helpers for the exactness tests: run a module at tp=N and gather what it computed."""

from __future__ import annotations

import argparse

import torch

from tpkit.layers.sharding import full_state_dict, shard, split_of, splits_of


def shard_state_dict(module: torch.nn.Module, full: dict[str, torch.Tensor], rank: int,
                     tp: int) -> dict[str, torch.Tensor]:
    """Cut a full (tp=1) state dict into what `module` (on `rank` of `tp`) holds."""
    out = {}
    for name, p in module.named_parameters():
        split = split_of(p)
        out[name] = full[name] if split is None or tp == 1 else shard(full[name], split, rank, tp)
    return out


def random_full_state(module: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random values for every parameter of a tp=1 module (biases included, unlike init)."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * 0.5 for n, p in module.named_parameters()}


def load_shards(module: torch.nn.Module, full: dict[str, torch.Tensor], group) -> None:
    """Load this rank's slice of a full state dict."""
    local = shard_state_dict(module, full, group.rank, group.size)
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(local[n])


def local_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> this rank's gradient."""
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def gather_grads(per_rank: list[dict], splits: dict) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's local ones, using the split tags of that layout."""
    return full_state_dict(per_rank, splits)


__all__ = ["gather_grads", "load_shards", "local_grads", "max_diff", "random_full_state",
           "splits_of"]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| (shapes must match)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def generate_args(*argv: str) -> argparse.Namespace:
    """`tpkit generate ARGV` as its own parser reads them, every default included (a
    Namespace written by hand drifts when a flag is added)."""
    from tpkit.commands import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(list(argv))
