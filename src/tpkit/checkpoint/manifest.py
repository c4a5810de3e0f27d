"""Writing a sharded checkpoint's records: one JSON record per rank beside its shards,
then the manifest that merges them, written last (a directory without it is
incomplete); `dest.install` then renames the folder into place.

    write_record(tmp, mesh, config, params=..., optim=..., groups=..., extra=...)
    write_manifest(tmp, config, optimizer, step, layout, run=...)  # rank 0, after all

`save` and `convert.reshard` both write through these (the latter for every rank of
a layout, from one process, over a `ParallelMesh.virtual`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tpkit.checkpoint.disk import writing
from tpkit.spec.grid import world_of
from tpkit.weights.files import (
    FORMAT,
    MANIFEST,
    VERSION,
    file_entry,
    fsync_path,
    model_file,
    optim_file,
    rank_file,
    split_to_json,
    write_json,
)
from tpkit.weights.finite import NonFiniteCheckpoint, first_nonfinite
from tpkit.weights.finite import describe as describe_nonfinite
from tpkit.weights.tokenizer import TOKENIZER_FILES

PAUSE_ENV = "TPKIT_CKPT_PAUSE_S"  # tests: sleep after each file, to kill a save midway


def write_record(tmp: Path, mesh, config, *, params: dict, optim: dict, groups: list | None,
                 extra: dict) -> None:
    """Write one rank's shards (name -> (local tensor, split)) and its JSON record; `mesh`
    (a real or virtual `ParallelMesh`) says which rank, tp rank and stage it is."""
    rank, tp_rank, stage, tp = mesh.rank, mesh.tp_rank, mesh.pp_rank, mesh.tp_size
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


def write_manifest(tmp: Path, config: dict | None, optimizer: str | None, step: int,
                   layout: dict, *, run: str | None = None) -> None:
    """Merge the per-rank records in `tmp` into the manifest (written last). Every file
    in `tmp` is listed with its checksum, the tokenizer's too; `run`: the id of the
    training run that wrote it (`retention`: a run folder belongs to one run)."""
    world = world_of(**layout)  # {"tp", "pp", "dp"} and "cp" when > 1
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
    if run is not None:
        manifest["run"] = run
    with writing(tmp / MANIFEST):
        write_json(tmp / MANIFEST, manifest)  # last: a directory without it is incomplete
        fsync_path(tmp)


def _pause() -> None:
    if os.environ.get(PAUSE_ENV):
        time.sleep(float(os.environ[PAUSE_ENV]))
