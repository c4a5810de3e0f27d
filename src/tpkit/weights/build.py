"""The one builder: a model at a mesh's coordinate, empty or holding a source's weights.

    model = build_model(config, mesh, source, dtype=...)   # meta -> allocate -> load
    model = build_model(config, mesh, seed=1)               # fresh weights (no source)
    shell = empty_model(config, mesh)                       # meta: names, shapes, tags

With a source the model is built on the meta device (no memory, no init), allocated on
the mesh's device, and filled by `load_weights`: every rank stages its slices
(`slices.read_local`), the ranks agree, and only then is anything copied in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpkit.comm import all_reduce
from tpkit.host import memory
from tpkit.host.memory import gib
from tpkit.layers.lora import reset_adapters
from tpkit.layers.sharding import materialize
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import UserError
from tpkit.weights.agree import attempt, raise_unless_all
from tpkit.weights.finite import nonfinite, warn_nonfinite
from tpkit.weights.slices import Source, read_local


def build_model(config: ModelConfig, mesh: ParallelMesh, source: Source | None = None,
                **kw: Any) -> nn.Module:
    """`Transformer(config, mesh, **kw)`; with `source`, holding its weights (this
    rank's slices only). Call on every rank of the mesh."""
    if source is None:
        return Transformer(config, mesh, **kw)
    model = Transformer(config, mesh, device="meta", **kw)
    raise_unless_all(mesh, attempt(check_room, model, mesh.device, source.where),
                     f"{source.where}: another rank has no room for its weights (see its "
                     f"error); nothing was loaded")
    model = materialize(model, mesh.device)
    reset_adapters(model)  # LoRA: a base model's source has none
    load_weights(model, source, mesh)
    return model


def check_room(model: nn.Module, device: torch.device | str, where: str) -> None:
    """One UserError line when the weights of a meta-built model would not fit the memory
    this machine (or its cgroup) still offers: said before anything is allocated, rather
    than the kernel killing this or another process. Host memory only (a GPU says so
    itself, without harm to others)."""
    if torch.device(device).type != "cpu" or (room := memory.available()) is None:
        return
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    if need > room[0]:
        raise UserError(f"{where}: the weights of {model.config.name} need {gib(need)} on "
                        f"this rank, more than the {gib(room[0])} available ({room[1]})")


def empty_model(config: ModelConfig, mesh: Any, **kw: Any) -> nn.Module:
    """The model on the meta device at `mesh`'s coordinate: names, shapes and split tags,
    no memory."""
    return Transformer(config, mesh, device="meta", **kw)


def load_weights(model: nn.Module, source: Source, mesh: ParallelMesh) -> None:
    """Copy this rank's slice of every parameter out of `source`, once every rank has
    staged its own without error (else nothing changes, on any rank)."""
    staged, err = {}, None
    try:
        staged = read_local(model, source, mesh)
    except Exception as e:  # noqa: BLE001 - re-raised once every rank has answered
        err = e
    raise_unless_all(mesh, err, f"{source.where}: another rank failed to load (see its "
                                f"error); nothing was loaded")
    warn_nonfinite(_nonfinite_anywhere(staged, source, mesh), source.where, mesh.rank == 0)
    copy_in(model, staged)


def _nonfinite_anywhere(staged: dict[str, torch.Tensor], source: Source,
                        mesh: ParallelMesh) -> list[str]:
    """The tensors of `source` that hold NaN or inf in any rank's slice, known to every
    rank (one max over the world of a flag per tensor)."""
    names = sorted(source.names)
    found = {n for n, _, _ in nonfinite(staged)}
    flags = torch.tensor([float(n in found) for n in names] + [float(bool(found - set(names)))],
                         device=mesh.device)
    all_reduce(flags, mesh.mp_group, op="max", phase="checkpoint")
    all_reduce(flags, mesh.dp_cp_group, op="max", phase="checkpoint")
    return [n for n, f in zip([*names, "another tensor"], flags.tolist()) if f]


def copy_in(model: nn.Module, staged: dict[str, torch.Tensor]) -> None:
    """Copy staged tensors (name -> this rank's slice) into the model's parameters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in staged:  # all but the adapters a base model's source lacks
                p.copy_(staged[name])
