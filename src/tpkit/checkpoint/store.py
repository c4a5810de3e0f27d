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

import base64
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tpkit.checkpoint import optim_state
from tpkit.checkpoint.agree import attempt, raise_unless_all
from tpkit.checkpoint.build import copy_in
from tpkit.checkpoint.disk import writing
from tpkit.checkpoint.files import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    ShardedSource,
    file_entry,
    fsync_path,
    model_file,
    optim_file,
    rank_file,
    read_manifest,
    split_to_json,
    verify_file,
    write_json,
)
from tpkit.checkpoint.finite import NonFiniteCheckpoint, first_nonfinite
from tpkit.checkpoint.finite import describe as describe_nonfinite
from tpkit.checkpoint.slices import read_local
from tpkit.device import rng_state, set_rng_state
from tpkit.mesh import ParallelMesh
from tpkit.model.tokenizer import TOKENIZER_FILES, copy_tokenizer
from tpkit.parallel.zero import ZeroAdamW
from tpkit.sharding import meta_of, split_of

__all__ = ["CheckpointError", "capture_rng", "complete", "discard", "load", "prune",
           "read_manifest", "restore_rng", "save"]

Optimizer = torch.optim.Optimizer | ZeroAdamW  # what save / load accept
PAUSE_ENV = "TPKIT_CKPT_PAUSE_S"  # tests: sleep after each file, to kill a save midway
IGNORED_CONFIG = ("name", "dropout")  # differences that do not change the weights


# -- public API -------------------------------------------------------------------------
def save(path: str | Path, model: nn.Module, optimizer: Optimizer | None = None,
         *, step: int = 0, extra: dict | None = None, mesh: ParallelMesh | None = None,
         tokenizer: str | Path | None = None) -> Path:
    """Write a checkpoint of this rank's shards into `path`, atomically; call on every rank.

    `optimizer`: torch AdamW (or any torch optimizer) or `ZeroAdamW`, whose slices are
    gathered over dp into the same per-parameter state.

    `extra` (per rank; JSON values and tensors, e.g. the data-loader position and
    `capture_rng()`) comes back from `load`. `tokenizer`: a folder whose tokenizer files
    travel inside the checkpoint (listed in the manifest like every file). Returns the
    checkpoint directory.
    """
    mesh = mesh or getattr(model, "mesh", None) or ParallelMesh.single()
    root = Path(path)
    tmp = root.parent / f".{root.name}.tmp"
    err = attempt(_make_tmp, tmp) if mesh.rank == 0 else None
    try:
        raise_unless_all(mesh, err, f"{root}: rank 0 could not create {tmp}")
        state = optim_state.gather_state(optimizer) if optimizer is not None else None  # ZeRO
        err = attempt(_write_rank, tmp, model, optimizer, state, extra, mesh)
        raise_unless_all(mesh, err, f"{root}: another rank failed to write its shards; "
                                    f"the previous checkpoint is untouched")
        if mesh.rank == 0:
            err = attempt(_finish, tmp, root, model, optimizer, step, mesh, tokenizer)
        raise_unless_all(mesh, err, f"{root}: rank 0 failed to write the manifest")
    except BaseException:  # every rank has stopped writing: nothing half-written stays
        if mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def _make_tmp(tmp: Path) -> None:
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


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoints (readable manifest) under `root`, oldest step first."""
    found = []
    for d in Path(root).iterdir() if Path(root).is_dir() else []:
        if d.is_dir() and not d.name.startswith(".") and (d / MANIFEST).is_file():
            try:
                found.append((read_manifest(d)["step"], d.name, d))
            except CheckpointError:
                continue
    return [d for _, _, d in sorted(found)]


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints under `root` (call after a
    save completed, on one rank); returns what was deleted. Each goes first to a hidden
    name (atomic), so a kill midway never leaves a damaged checkpoint that looks whole."""
    if keep < 1:
        return []
    old = complete(root)[:-keep]
    for d in old:
        discard(d)
    return old


def discard(path: Path) -> None:
    """Delete a checkpoint directory: renamed to a hidden name first (atomic), so that a
    kill midway never leaves a damaged checkpoint that looks complete."""
    aside = path.parent / f".{path.name}.deleting"
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def capture_rng(device: torch.device | None = None) -> dict:
    """This process's generator states (torch on `device`, Python), for `extra`."""
    version, state, gauss = random.getstate()
    return dict(torch=rng_state(device or torch.device("cpu")),
                python=[version, list(state), gauss])


def restore_rng(state: dict, device: torch.device | None = None) -> None:
    """Restore what `capture_rng` returned (after a load)."""
    set_rng_state(state["torch"], device or torch.device("cpu"))
    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))


# -- writing ----------------------------------------------------------------------------
def _write_rank(tmp: Path, model: nn.Module, optimizer, state: optim_state.State | None,
                extra: dict | None, mesh: ParallelMesh) -> None:
    params, optim, groups = {}, {}, None
    if mesh.dp_rank == 0:  # dp replicas hold the same shards: replica 0 writes them
        params = {n: (q.detach(), split_of(q)) for n, q in _own_params(model).items()}
        if optimizer is not None:
            optim = optim_state.state_tensors(_own_params(model), state)
            groups = _encode(optim_state.group_settings(optimizer))
    write_record(tmp, mesh.rank, mesh.tp_rank, mesh.pp_rank, mesh.tp_size,
                 getattr(model, "config", None), params, optim, groups, _encode(extra or {}))


def write_record(tmp: Path, rank: int, tp_rank: int, stage: int, tp: int, config,
                 params: dict, optim: dict, groups: list | None, extra: dict) -> None:
    """Write one rank's shards (name -> (local tensor, split)) and its JSON record."""
    record: dict[str, Any] = dict(rank=rank, files={}, optim_groups=groups, extra=extra)
    for kind, tensors, fname in (("tensors", params, model_file(tp_rank, stage)),
                                 ("optim_tensors", optim, optim_file(tp_rank, stage))):
        record[kind] = {n: _meta(sp, t.shape, t.dtype, tp, stage, config)
                        for n, (t, sp) in tensors.items()}
        if tensors:
            cpu = {n: t.detach().to("cpu").contiguous() for n, (t, _) in tensors.items()}
            if (bad := first_nonfinite(cpu)) is not None:
                raise NonFiniteCheckpoint(f"{tmp.parent / tmp.name[1:-4]}: not written: "
                                          f"{describe_nonfinite(bad)}")
            with writing(tmp / fname, sum(t.numel() * t.element_size() for t in cpu.values())):
                save_file(cpu, str(tmp / fname), metadata={"tpkit": json.dumps(record[kind])})
                fsync_path(tmp / fname)
            record["files"][fname] = file_entry(tmp / fname)
            _pause()
    with writing(tmp / rank_file(rank)):
        write_json(tmp / rank_file(rank), record)
    _pause()


def _meta(split, local_shape, dtype: torch.dtype, tp: int, stage: int, config) -> dict:
    """Global and logical (unpadded) shape and split tag of a tensor."""
    shape = list(local_shape)
    if split is not None:
        shape[split.dim] = sum(split.parts)
    logical = list(shape)
    if (config is not None and split is not None and split.dim == 0 and len(split.parts) == 1
            and shape[0] == config.padded_vocab(tp) > config.vocab_size):
        logical[0] = config.vocab_size  # vocabulary padding is not part of the model
    return dict(shape=shape, logical=logical, split=split_to_json(split), stage=stage,
                dtype=str(dtype).removeprefix("torch."))


def _own_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters this stage owns (a pipeline copy of a tied embedding is saved once)."""
    return {n: p for n, p in model.named_parameters() if not meta_of(p).tied_to}


def _finish(tmp: Path, root: Path, model: nn.Module, optimizer, step: int,
            mesh: ParallelMesh, tokenizer: str | Path | None) -> None:
    if tokenizer is not None:
        with writing(tmp / "tokenizer files"):
            copy_tokenizer(tokenizer, tmp)
    config = getattr(model, "config", None)
    write_manifest(tmp, root, config.to_dict() if config is not None else None,
                   type(optimizer).__name__ if optimizer is not None else None, step,
                   mesh.layout)


def write_manifest(tmp: Path, root: Path, config: dict | None, optimizer: str | None,
                   step: int, layout: dict) -> None:
    """Merge the per-rank records in `tmp` into the manifest (written last), then move
    `tmp` to `root` (replacing a previous checkpoint there only now). Every file in
    `tmp` is listed with its checksum, the tokenizer's too."""
    world = layout["tp"] * layout["pp"] * layout["dp"]
    records = [json.loads((tmp / rank_file(r)).read_text()) for r in range(world)]
    files, tensors, optim_tensors = {}, {}, {}
    for r, rec in enumerate(records):
        files.update(rec["files"])
        files[rank_file(r)] = file_entry(tmp / rank_file(r))
        tensors.update(rec["tensors"])
        optim_tensors.update(rec["optim_tensors"])
    for name in TOKENIZER_FILES:
        if (tmp / name).is_file():
            files[name] = file_entry(tmp / name)
    manifest = dict(format=FORMAT, version=VERSION, step=step, config=config, layout=layout,
                    tensors=tensors, optim_tensors=optim_tensors,
                    optimizer=dict(type=optimizer, groups=records[0]["optim_groups"])
                    if optimizer else None,
                    extra=records[0]["extra"], files=files, saved_at=time.time())
    with writing(tmp / MANIFEST):
        write_json(tmp / MANIFEST, manifest)  # last: a directory without it is incomplete
        fsync_path(tmp)
    aside = root.parent / f".{root.name}.old"
    shutil.rmtree(aside, ignore_errors=True)
    if root.exists():
        os.rename(root, aside)
    os.rename(tmp, root)
    fsync_path(root.parent)
    shutil.rmtree(aside, ignore_errors=True)


# -- reading ----------------------------------------------------------------------------
def _check_config(root: Path, manifest: dict, model: nn.Module) -> None:
    config, saved = getattr(model, "config", None), manifest.get("config")
    if config is None or saved is None:
        return
    mine = config.to_dict()
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
                        _decode(manifest["optimizer"]["groups"]))
    rank = mesh.rank if mesh.layout == manifest["layout"] else 0
    fname = rank_file(rank)
    record = json.loads(verify_file(root, fname, manifest["files"].get(fname)).read_text())
    extra = _decode(record["extra"])
    extra.setdefault("step", manifest["step"])
    extra["layout"] = manifest["layout"]  # the one record of it: {"tp", "pp", "dp"}
    return params, staged_optim, extra


# -- helpers ----------------------------------------------------------------------------
def _pause() -> None:
    if os.environ.get(PAUSE_ENV):
        time.sleep(float(os.environ[PAUSE_ENV]))


def _encode(obj: Any) -> Any:
    """JSON form of nested dicts/lists with tensors (base64 of the raw bytes)."""
    if torch.is_tensor(obj):
        t = obj.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": base64.b64encode(raw).decode(), "dtype": str(t.dtype)[6:],
                "shape": list(t.shape)}
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"checkpoint extra: cannot store a {type(obj).__name__} (use JSON values "
                    f"and tensors)")


def _decode(obj: Any) -> Any:
    """Inverse of `_encode`."""
    if isinstance(obj, dict) and "__tensor__" in obj:
        raw = bytearray(base64.b64decode(obj["__tensor__"]))
        dtype = getattr(torch, obj["dtype"])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(obj["shape"]).clone()
    if isinstance(obj, dict):
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj
