"""The files of a sharded checkpoint (names, manifest, sizes and sha256), and
`ShardedSource`, which reads any slice of a global tensor back out of them.

A checkpoint directory, written at (tp, pp, dp):

    manifest.json                      written last: config, step, layout, tensor table,
                                       optimizer layout, extra, sha256 + size of every file
    model-tp{t}-pp{p}.safetensors      what tp rank t of stage p holds (dp replica 0)
    optim-tp{t}-pp{p}.safetensors      its optimizer state, same tags ("{param}::{key}")
    rank-{r}.json                      per-rank extra (RNG states...), no pickle

Every tensor is described by its global shape (`shape`, padded vocabulary included),
its `logical` shape (without padding) and its split tag. Reading a slice for a new
layout goes through `Source.read(name, dim, start, stop)` — the rows [start, stop) of
the logical global tensor along `dim` — so a rank reads only what it will hold,
from a sharded checkpoint, one full file, or a Hugging Face model (`weights.hf`).

    global rows of a fused part, written at tp=2, read at tp=4 by rank 1:
      part q: [ chunk0 (rank 0) | chunk1 (rank 1) ]      rank 1 wants q rows [c/2, c)
                                   ^ read from rank 0's file, local rows [c/2, c)
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tpkit.layers.sharding import TPSplit, unshard
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import CheckpointError
from tpkit.weights.slices import FullSource

MANIFEST = "manifest.json"
FORMAT = "tpkit-checkpoint"
VERSION = 1
FULL_FORMAT = "tpkit-full"  # the "format" in a full file's metadata (`convert.to_full`)
_VERIFIED: set[tuple] = set()  # (path, inode, size, mtime, sha256) this process checked


def model_file(tp_rank: int, pp_rank: int) -> str:
    """File name of one (tp rank, stage) model shard."""
    return f"model-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def optim_file(tp_rank: int, pp_rank: int) -> str:
    """File name of one (tp rank, stage) optimizer shard."""
    return f"optim-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def is_optim_file(name: str) -> bool:
    """Whether `name` is an optimizer shard (only a resumed run reads those)."""
    return name.startswith("optim-")


def rank_file(rank: int) -> str:
    """File name of one global rank's extra state."""
    return f"rank-{rank:05d}.json"


# -- split tags as JSON -----------------------------------------------------------------
def split_to_json(split: TPSplit | None) -> dict | None:
    """A split tag as plain JSON (None: replicated)."""
    return None if split is None else split.to_json()


def split_from_json(d: dict | None, tp: int) -> TPSplit | None:
    """Inverse of `split_to_json`, for a checkpoint saved at `tp` (older manifests)."""
    return None if d is None else TPSplit.from_json(d, tp)


# -- durable writes ---------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """Flush a file (or a directory entry) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON and fsync it."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def file_entry(path: Path) -> dict:
    """{"sha256", "bytes"} of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return dict(sha256=h.hexdigest(), bytes=path.stat().st_size)


def size_problem(root: Path, name: str, entry: dict | None) -> str | None:
    """Why `name` cannot be the file the manifest lists (absent, or another size), or None.
    Cheap: no checksum (`verify_file` adds it)."""
    path = root / name
    if entry is None:
        return f"{path}: not listed in {root / MANIFEST}"
    try:  # a prune running beside this check may remove the file between these two stats
        size = path.stat().st_size if path.is_file() else None
    except FileNotFoundError:
        size = None
    if size is None:
        return f"{path}: missing shard (listed in {MANIFEST})"
    if size != entry["bytes"]:
        return (f"{path}: truncated or resized: {size} bytes on disk, "
                f"{entry['bytes']} in {MANIFEST}")
    return None


def verify_file(root: Path, name: str, entry: dict | None) -> Path:
    """The path of `name` after checking it exists, has its size and its sha256. A file
    this process (or the one that sent it a `ShardedSource`) already hashed, unchanged
    since (same inode, size and mtime), is not hashed again."""
    path = root / name
    problem = size_problem(root, name, entry)
    if problem:
        raise CheckpointError(problem)
    st = path.stat()
    stamp = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, entry["sha256"])
    if stamp not in _VERIFIED:
        if file_entry(path)["sha256"] != entry["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (sha256 differs from "
                                  f"{MANIFEST}): the file is corrupted")
        _VERIFIED.add(stamp)
    return path


def first_mismatch(root: Path, manifest: dict, names: list[str]) -> str | None:
    """Why one of the files `names` of a checkpoint is not the one its manifest lists
    (missing, resized, another sha256), or None; hashed in parallel threads (hashlib
    lets go of the GIL), each file once per process (`verify_file`)."""
    def problem(name: str) -> str | None:
        try:
            verify_file(root, name, manifest["files"].get(name))
        except (CheckpointError, OSError) as e:  # OSError: deleted while being read
            return str(e)
        return None

    with ThreadPoolExecutor(max(1, min(8, len(names), os.cpu_count() or 1))) as pool:
        return next((p for p in pool.map(problem, names) if p), None)


def _verified_under(root: Path) -> list[tuple]:
    """The files under `root` this process found matching their sha256."""
    where = str(root.resolve()) + os.sep
    return [stamp for stamp in _VERIFIED if stamp[0].startswith(where)]


def read_manifest(root: str | Path) -> dict:
    """The manifest of a checkpoint directory, or a CheckpointError saying why not."""
    root = Path(root)
    path = root / MANIFEST
    if root.is_file():
        raise CheckpointError(f"{root}: a file, not a checkpoint directory")
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing: the save did not finish, or {root} is not "
                              f"a tpkit checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable manifest: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: version {manifest['version']} is newer than this "
                              f"tpkit reads ({VERSION})")
    return manifest


def saved_config(d: dict, where: Path | str) -> ModelConfig:
    """The ModelConfig a manifest or a full file's metadata holds; one CheckpointError
    line naming `where` when it is not one (an unknown field, a size out of bounds)."""
    try:
        return ModelConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: its model config is unreadable: {e}") from None


class ShardedSource:
    """Reads global slices out of the per-rank files of a checkpoint, verifying each file
    (size + sha256) the first time it is opened. `kind`: "model" (the weights) or
    "optim" (the optimizer state, same files' optim- twins)."""

    def __init__(self, root: str | Path, manifest: dict, kind: str = "model") -> None:
        self.root, self.manifest, self.kind = Path(root), manifest, kind
        self.where, self.tp = str(root), manifest["layout"]["tp"]
        self.tensors = manifest["tensors"] if kind == "model" else manifest["optim_tensors"]
        self.config = saved_config(manifest["config"], self.root / MANIFEST) \
            if manifest["config"] else None
        self.names = set(self.tensors)
        self._open: dict[str, Any] = {}

    def __getstate__(self) -> dict:  # picklable (to the ranks): files are opened again,
        # and those already hashed here are not hashed again there (if unchanged)
        return {**vars(self), "_open": {}, "_verified": _verified_under(self.root)}

    def __setstate__(self, state: dict) -> None:
        _VERIFIED.update(state.pop("_verified", ()))
        vars(self).update(state)

    def logical_shape(self, name: str) -> tuple[int, ...] | None:
        """Global shape without padding (None: not in this checkpoint)."""
        meta = self.tensors.get(name)
        return None if meta is None else tuple(meta["logical"])

    def _local(self, tp_rank: int, stage: int, name: str, dim: int, a: int, b: int | None
               ) -> torch.Tensor:
        fname = (model_file if self.kind == "model" else optim_file)(tp_rank, stage)
        if fname not in self._open:
            path = verify_file(self.root, fname, self.manifest["files"].get(fname))
            self._open[fname] = safe_open(str(path), framework="pt")
        f = self._open[fname]
        if name not in f.keys():
            raise CheckpointError(f"{self.root / fname}: tensor {name!r} is missing from the file")
        sl = f.get_slice(name)
        if not sl.get_shape():
            return f.get_tensor(name)
        return sl[(slice(None),) * dim + (slice(a, b),)]

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along `dim`, from the files of the ranks that hold them."""
        meta = self.tensors[name]
        split, stage = split_from_json(meta["split"], self.tp), meta["stage"]
        if split is None or self.tp == 1:
            return self._local(0, stage, name, dim, start, stop)
        if split.dim != dim:  # unusual: gather the whole tensor, then cut
            full = unshard([self._local(r, stage, name, 0, 0, None) for r in range(self.tp)],
                           split)
            return full.narrow(dim, start, stop - start)
        return torch.cat(list(self._pieces(split, stage, name, start, stop)), dim)

    def _pieces(self, split: TPSplit, stage: int, name: str, start: int, stop: int):
        for owner, pc in split.owned_pieces(self.tp):  # every chunk once, in global order
            lo, hi = max(start, pc.start), min(stop, pc.start + pc.size)
            if lo < hi:
                a = pc.local_start + lo - pc.start
                yield self._local(owner, stage, name, split.dim, a, a + hi - lo)


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order: the
    checksum a full file carries in its metadata (a file cannot hold its own hash)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def verify_full(path: Path, src: FullSource, meta: dict) -> None:
    """CheckpointError naming the file unless its tensors match the sha256 it carries
    (files written before the checksum existed carry none and are read as they are)."""
    if "sha256" in meta and tensors_digest({n: src.f.get_tensor(n) for n in src.names}) \
            != meta["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch: its tensors do not match the "
                              f"sha256 in its metadata (the file is damaged)")
