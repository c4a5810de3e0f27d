"""`tpkit convert`: checkpoints to and from one full safetensors file, offline resharding,
Hugging Face export — in one process, without a process per rank.

    tpkit convert runs/ckpt/step-100 model.safetensors --to full      # logical tensors
    tpkit convert model.safetensors ckpt-tp4 --to sharded --tp 4 --pp 2
    tpkit convert runs/ckpt/step-100 ckpt-tp1 --to sharded --tp 1     # + optimizer state
    tpkit convert runs/ckpt/step-100 hf-out --to hf                    # transformers loads it

Resharding builds the model of each target coordinate on the meta device (no
memory, no init), reads its split tags, and asks the source for exactly those
slices (`ckpt_io.local_slice`): the tags, never the names, decide the layout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tpkit.checkpoint.files import (
    MANIFEST,
    CheckpointError,
    FullSource,
    ShardedSource,
    local_slice,
    read_manifest,
    verify_file,
)
from tpkit.comm.group import CommGroup
from tpkit.comm.ledger import Ledger
from tpkit.sharding import split_of
from tpkit.spec.config import ModelConfig

FULL_FORMAT = "tpkit-full"


def offline_mesh(tp: int, pp: int, tp_rank: int, pp_rank: int) -> SimpleNamespace:
    """What a model constructor reads of a mesh, for one coordinate, with no processes."""
    ledger = Ledger()
    return SimpleNamespace(
        tp_size=tp, pp_size=pp, dp_size=1, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=0,
        rank=pp_rank * tp + tp_rank, world_size=tp * pp, ledger=ledger,
        device=torch.device("cpu"),
        tp_group=CommGroup("tp", tuple(range(tp)), tp_rank, None, ledger),
        pp_group=CommGroup("pp", tuple(range(pp)), pp_rank, None, ledger))


def meta_model(config: ModelConfig, tp: int, pp: int, tp_rank: int, pp_rank: int,
               names: set[str] | None = None) -> nn.Module:
    """The model of one coordinate on the meta device (names, shapes, split tags only)."""
    from tpkit.model.hf import build_model

    mesh = offline_mesh(tp, pp, tp_rank, pp_rank)
    return build_model(config, mesh, device="meta",
                       pooler=names is not None and "pooler.weight" in names)


def to_hf(source: Any, out_dir: str | Path, config: ModelConfig | None = None) -> Path:
    """A Hugging Face directory from a checkpoint dir, a full file, a tp=1 model or a dict."""
    from tpkit.model.hf import write_hf

    return write_hf(*open_source(source, config), out_dir)


def open_source(source: Any, config: ModelConfig | None = None
                ) -> tuple[Any, ModelConfig, set[str]]:
    """(Source, config, tensor names) of a checkpoint dir, full file, HF dir, model or dict."""
    if isinstance(source, nn.Module | dict):
        from tpkit.model.hf import memory_source

        return memory_source(source, config)
    path = Path(source)
    if (path / MANIFEST).is_file():
        m = read_manifest(path)
        return ShardedSource(path, m), ModelConfig.from_dict(m["config"]), set(m["tensors"])
    if path.is_file():
        src = FullSource(path)
        meta = json.loads((src.f.metadata() or {}).get("tpkit", "{}"))
        if meta.get("format") != FULL_FORMAT:
            raise CheckpointError(f"{path}: not a tpkit full safetensors file (no metadata)")
        _verify_full(path, src, meta)
        return src, config or ModelConfig.from_dict(meta["config"]), src.names
    if (path / "config.json").is_file():
        from tpkit.model.hf import HFSource, config_from_hf, open_hf, table

        hf, tensors, where = open_hf(path)
        fam, cfg = config_from_hf(hf)
        src = HFSource(tensors, table(fam, cfg), where)
        return src, cfg, {n for n in src.recipes if src.logical_shape(n) is not None}
    raise CheckpointError(f"{path}: neither a tpkit checkpoint (manifest.json), a full "
                          f"safetensors file, nor a Hugging Face directory (config.json)")


def to_full(source: Any, out: str | Path) -> Path:
    """Write every logical tensor (no padding, tied copies once) into one safetensors file."""
    src, config, names = open_source(source)
    tensors = {}
    for n in sorted(names):
        shape = src.logical_shape(n)
        tensors[n] = (src.read(n, 0, 0, shape[0]) if shape else src.read(n, 0, 0, 1)
                      ).contiguous().clone()
    step = read_manifest(source)["step"] if (Path(source) / MANIFEST).is_file() else 0
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(format=FULL_FORMAT, config=config.to_dict(), step=step,
                sha256=tensors_digest(tensors))
    tmp = out.parent / f".{out.name}.tmp"  # never a half-written file under `out`'s name
    save_file(tensors, str(tmp), metadata={"tpkit": json.dumps(meta)})
    os.replace(tmp, out)
    return out


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order: the
    checksum a full file carries in its metadata (a file cannot hold its own hash)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _verify_full(path: Path, src: FullSource, meta: dict) -> None:
    """CheckpointError naming the file unless its tensors match the sha256 it carries
    (files written before the checksum existed carry none and are read as they are)."""
    if "sha256" in meta and tensors_digest({n: src.f.get_tensor(n) for n in src.names}) \
            != meta["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch: its tensors do not match the "
                              f"sha256 in its metadata (the file is damaged)")


def reshard(source: Any, out: str | Path, tp: int, pp: int = 1) -> Path:
    """Write a sharded checkpoint at (tp, pp) from any source; optimizer state follows
    when the source is a sharded checkpoint that has it. Atomic like `checkpoint.save`."""
    from tpkit.checkpoint.store import write_manifest, write_record

    src, config, names = open_source(source)
    config.check(tp=tp, pp=pp)
    m = read_manifest(source) if isinstance(src, ShardedSource) else None
    optim_src = ShardedSource(source, m, "optim") if m and m.get("optimizer") else None
    root = Path(out)
    tmp = root.parent / f".{root.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    extra = _rank0_extra(source, m)
    for p in range(pp):
        for t in range(tp):
            model = meta_model(config, tp, pp, t, p, names)
            params = _slices(src, model, t, tp, config, str(source))
            optim = _optim_slices(optim_src, m, model, t, tp, str(source)) if optim_src else {}
            groups = m["optimizer"]["groups"] if optim_src else None
            write_record(tmp, p * tp + t, t, p, tp, config, params, optim, groups, extra)
    write_manifest(tmp, root, config.to_dict(), m["optimizer"]["type"] if optim_src else None,
                   m["step"] if m else 0, dict(tp=tp, pp=pp, dp=1))
    return root


def _slices(src, model, t: int, tp: int, config, where: str) -> dict:
    out = {}
    for n, p in model.named_parameters():
        if getattr(p, "tied_to", None):
            continue
        x = local_slice(src, n, split_of(p), t, tp, tuple(p.shape), where)
        out[n] = (x.to(p.dtype), split_of(p))
    return out


def _optim_slices(src: ShardedSource, m: dict, model, t: int, tp: int, where: str) -> dict:
    out = {}
    for n, p in model.named_parameters():
        for full in (k for k in m["optim_tensors"] if k.split("::")[0] == n):
            scalar = m["optim_tensors"][full]["logical"] == []
            shape, split = ((), None) if scalar else (tuple(p.shape), split_of(p))
            out[full] = (local_slice(src, full, split, t, tp, shape, where), split)
    return out


def _rank0_extra(source: Any, m: dict | None) -> dict:
    if m is None:
        return {}
    path = verify_file(Path(source), "rank-00000.json", m["files"].get("rank-00000.json"))
    return json.loads(path.read_text())["extra"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit convert`."""
    parser.add_argument("source", help="tpkit checkpoint dir, full .safetensors, or HF dir")
    parser.add_argument("dest", help="output path")
    parser.add_argument("--to", choices=("full", "sharded", "hf"), default="sharded",
                        help="one full safetensors file, a sharded checkpoint, or Hugging Face")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sharded)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (sharded)")


def run(args: argparse.Namespace) -> int:
    """Convert; print what was written. Errors (CheckpointError, a UserError) name the
    file and the problem, on one line, from `tpkit.cli`."""
    if args.to == "full":
        out = to_full(args.source, args.dest)
    elif args.to == "hf":
        out = to_hf(args.source, args.dest)
    else:
        out = reshard(args.source, args.dest, args.tp, args.pp)
    print(f"wrote {out}")
    return 0
