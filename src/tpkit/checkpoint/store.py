"""Sharded, reshardable checkpoints: every rank writes its own shards, any layout reads them.

    save(dir, model, optimizer, step=100, extra=dict(loader=..., rng=...), mesh=mesh)
    extra = load(dir, model, optimizer, mesh=mesh)     # at any (tp, pp) the model admits

A save is atomic. All ranks write into `.<dir>.tmp` (model and optimizer shards by
dp replica 0, a small JSON per rank), fsync, meet; rank 0 then writes the manifest
(sha256 and size of every file) last and renames the directory into place. A save
killed midway leaves the previous checkpoint at `dir` untouched.

A load reads, per parameter, only the chunks this rank holds at *its* layout
(`slices.read_local`, driven by the split tags of the model being loaded), checks
every file it opens against the manifest, stages everything, and copies into the
model only when every rank has staged without error: nothing is ever half-loaded.
Optimizer state (AdamW's exp_avg, exp_avg_sq: same shape as the parameter) carries
the parameter's tag and reshards the same way; ZeRO-1's flat dp slices are gathered
into that same per-parameter form (`optim_state`), so either optimizer, at any dp,
reads a file either one wrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from tpkit.checkpoint import optim_state
from tpkit.checkpoint.codec import decode, encode
from tpkit.checkpoint.dest import check_dest, install
from tpkit.checkpoint.disk import writing
from tpkit.checkpoint.manifest import write_manifest, write_record
from tpkit.layers.sharding import meta_of, split_of
from tpkit.mesh import ParallelMesh
from tpkit.parallel.zero import ZeroAdamW
from tpkit.spec.errors import CheckpointError
from tpkit.weights.agree import attempt, raise_unless_all
from tpkit.weights.build import copy_in
from tpkit.weights.files import (
    MANIFEST,
    ShardedSource,
    rank_file,
    read_manifest,
    saved_config,
    verify_file,
)
from tpkit.weights.finite import describe as describe_nonfinite
from tpkit.weights.finite import first_nonfinite
from tpkit.weights.paths import SHARDED
from tpkit.weights.slices import read_local
from tpkit.weights.tokenizer import copy_tokenizer

__all__ = ["CheckpointError", "load", "read_manifest", "save"]

Optimizer = torch.optim.Optimizer | ZeroAdamW  # what save / load accept
IGNORED_CONFIG = ("name", "dropout")  # differences that do not change the weights


# -- public API -------------------------------------------------------------------------
def save(path: str | Path, model: nn.Module, optimizer: Optimizer | None = None,
         *, step: int = 0, extra: dict | None = None, mesh: ParallelMesh | None = None,
         tokenizer: str | Path | None = None, run: str | None = None) -> Path:
    """Write a checkpoint of this rank's shards into `path`, atomically; call on every rank.

    `optimizer`: torch AdamW (or any torch optimizer) or `ZeroAdamW`, whose slices are
    gathered over dp into the same per-parameter state.

    `extra` (per rank; JSON values and tensors, e.g. the data-loader position and
    `capture_rng()`) comes back from `load`. `tokenizer`: a folder whose tokenizer files
    travel inside the checkpoint (listed in the manifest like every file). `run`: the id
    of the training run saving it, in the manifest. A previous checkpoint at `path` is
    replaced (only once this one is complete); anything else there is refused
    (`dest.check_dest`). Returns the checkpoint directory.
    """
    mesh = mesh or getattr(model, "mesh", None) or ParallelMesh.single()
    root = Path(path)
    tmp = root.parent / f".{root.name}.tmp"
    err = attempt(_make_tmp, root, tmp) if mesh.rank == 0 else None
    try:
        raise_unless_all(mesh, err, f"{root}: rank 0 could not create {tmp}")
        state = optim_state.gather_state(optimizer) if optimizer is not None else None  # ZeRO
        err = attempt(_write_rank, tmp, model, optimizer, state, extra, mesh)
        raise_unless_all(mesh, err, f"{root}: another rank failed to write its shards; "
                                    f"the previous checkpoint is untouched")
        if mesh.rank == 0:
            err = attempt(_finish, tmp, root, model, optimizer, step, mesh, tokenizer, run)
        raise_unless_all(mesh, err, f"{root}: rank 0 failed to write the manifest")
    except BaseException:  # every rank has stopped writing: nothing half-written stays
        if mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def _make_tmp(root: Path, tmp: Path) -> None:
    check_dest(root, SHARDED, overwrite=True)  # a checkpoint replaces only a checkpoint
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(tmp):
        tmp.mkdir(parents=True)


def load(path: str | Path, model: nn.Module, optimizer: Optimizer | None = None,
         *, mesh: ParallelMesh | None = None) -> dict:
    """Load a checkpoint written at any layout into `model` (and `optimizer`) at this one.

    `path`: a checkpoint directory (a run folder is the command's to resolve:
    `locate.sharded_dir`). Returns this rank's `extra` when the layout is unchanged,
    else rank 0's (plus `"step"` and the manifest's `"layout"`). Raises CheckpointError naming the file and the
    problem; on any error no rank changes anything.
    """
    mesh = mesh or getattr(model, "mesh", None) or ParallelMesh.single()
    root, staged = Path(path), []

    def stage() -> None:
        manifest = read_manifest(root)
        _check_config(root, manifest, model)
        staged.extend(_stage(ShardedSource(root, manifest), model, optimizer, mesh))

    raise_unless_all(mesh, attempt(stage), f"{root}: another rank failed to load (see its "
                                           f"error); nothing was loaded")
    params, staged_optim, extra = staged
    copy_in(model, params)
    if optimizer is not None and staged_optim is not None:
        optim_state.apply_state(optimizer, *staged_optim)
    return extra


# -- writing ----------------------------------------------------------------------------
def _write_rank(tmp: Path, model: nn.Module, optimizer, state: optim_state.State | None,
                extra: dict | None, mesh: ParallelMesh) -> None:
    params, optim, groups = {}, {}, None
    if mesh.dp_cp_rank == 0:  # dp x cp ranks hold the same shards: the first writes them
        params = {n: (q.detach(), split_of(q)) for n, q in _own_params(model).items()}
        if optimizer is not None:
            optim = optim_state.state_tensors(_own_params(model), state)
            groups = encode(optim_state.group_settings(optimizer))
    write_record(tmp, mesh, getattr(model, "config", None), params=params, optim=optim,
                 groups=groups, extra=encode(extra or {}))


def _own_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters this stage owns (a pipeline copy of a tied embedding is saved once)."""
    return {n: p for n, p in model.named_parameters() if not meta_of(p).tied_to}


def _finish(tmp: Path, root: Path, model: nn.Module, optimizer, step: int,
            mesh: ParallelMesh, tokenizer: str | Path | None, run: str | None) -> None:
    if tokenizer is not None:
        with writing(tmp / "tokenizer files"):
            copy_tokenizer(tokenizer, tmp)
    config = getattr(model, "config", None)
    write_manifest(tmp, config.to_dict() if config is not None else None,
                   type(optimizer).__name__ if optimizer is not None else None, step,
                   mesh.layout, run=run)
    install(tmp, root)  # replacing a previous checkpoint there only now


# -- reading ----------------------------------------------------------------------------
def _check_config(root: Path, manifest: dict, model: nn.Module) -> None:
    config, saved = getattr(model, "config", None), manifest.get("config")
    if config is None or saved is None:
        return
    mine = config.to_dict()
    # by its current names, derived values filled in (earlier manifests: None)
    saved = saved_config(saved, root / MANIFEST).to_dict()
    diffs = [f"{k}={saved.get(k)!r} in the checkpoint, {mine.get(k)!r} in the model"
             for k in sorted(set(mine) | set(saved))
             if k not in IGNORED_CONFIG and saved.get(k) != mine.get(k)]
    if diffs:
        raise CheckpointError(f"{root / MANIFEST}: written for a different model: "
                              + "; ".join(diffs))


def _stage(source: ShardedSource, model: nn.Module, optimizer, mesh: ParallelMesh) -> tuple:
    """(this rank's parameters, optimizer state and groups or None, extra), read only."""
    root, manifest = source.root, source.manifest
    params = read_local(model, source, mesh)
    if (bad := first_nonfinite(params)) is not None:  # written before saves were checked
        raise CheckpointError(f"{root}: {describe_nonfinite(bad)}: written by a run that "
                              f"diverged; load an earlier checkpoint")
    staged_optim = None
    if optimizer is not None:
        staged_optim = (optim_state.stage_state(source, model, optimizer, mesh),
                        decode(manifest["optimizer"]["groups"]))
    rank = mesh.rank if mesh.layout == manifest["layout"] else 0
    fname = rank_file(rank)
    record = json.loads(verify_file(root, fname, manifest["files"].get(fname)).read_text())
    extra = decode(record["extra"])
    extra.setdefault("step", manifest["step"])
    extra["layout"] = manifest["layout"]  # the one record of it: {"tp", "pp", "dp"} (+ "cp")
    return params, staged_optim, extra
