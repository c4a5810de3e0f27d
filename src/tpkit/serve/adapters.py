"""Several LoRA adapters over one served base, chosen per request (`tpkit serve --lora
NAME=DIR`): PEFT adapter folders (what `tpkit convert --to peft` writes, what PEFT's
`save_pretrained` saves), each request's rows adapted by the one its "model" names.

    adapters = read_all(["math=out/peft"], model.config, "base")   # rank 0, before any process
    served = Adapters(model, adapters)      # every rank: its shards, hooked into the linears
    with served.select(pieces):             # a forward's rows, each with its adapter
        forward(model, cache, pieces)

Each rank holds its shard, split as `layers.lora` trains them: a column-parallel base
(the fused qkv, fc1) B's rows of each part as the base's, A whole; a row-parallel one
(attention's out, fc2) A's input columns as the base's, B whole: the delta
s B (A x) of a row-parallel layer is added to the partial product before the base's
all-reduce, so an adapter sends nothing the base does not send.

Only the rows of a request with an adapter change: after the base's product of every
row (the same call, the same bits as without adapters), y[rows] += s (x[rows] A^T) B^T
in float32, per adapter among the forward's rows; a fused SwiGLU's adapted rows are
computed again unfused (act(x W^T + b + delta)). A forward with adapter rows runs its
layers one by one (`NativeLayer`, else the modules), never the one-call
`NativeStack`: that is the cost of an adapted step (docs/serving.md).
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.decode.native import forget
from tpkit.layers.lora import layer_parts, part_split
from tpkit.layers.sharding import shard
from tpkit.model.names import layer
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import UserError
from tpkit.weights.families import with_family
from tpkit.weights.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_module

PREFIX = "base_model.model."  # PEFT's names: PREFIX + module + ".lora_A.weight"


@dataclass
class Adapter:
    """One adapter folder, read whole: `tensors[(layer, path, target)] = (A [r, in],
    B [rows, r])` float32, `scale` = alpha / r (rsLoRA: alpha / sqrt(r))."""

    name: str
    folder: Path
    rank: int
    scale: float
    tensors: dict[tuple[int, str, str], tuple[torch.Tensor, torch.Tensor]]


def parse(specs: list[str]) -> list[tuple[str, Path]]:
    """--lora NAME=DIR values -> (name, folder); one line for a malformed or repeated one."""
    out: list[tuple[str, Path]] = []
    for s in specs:
        name, eq, folder = s.partition("=")
        if not (eq and name.strip() and folder.strip()):
            raise UserError(f"--lora {s!r}: expected NAME=ADAPTER_DIR")
        if name in (n for n, _ in out):
            raise UserError(f"--lora {name}: two adapters with one name")
        out.append((name, Path(folder)))
    return out


def _modules(c: ModelConfig) -> dict[str, tuple[int, str, int, str]]:
    """Hugging Face module -> (layer, tpkit path, part, LoRA target) of every linear part
    PEFT can adapt (a family's fused tensors have no module of their own)."""
    out = {}
    for i in range(c.num_layers):
        for path, parts in layer_parts(c).items():
            for j, (target, _) in enumerate(parts):
                try:
                    out[peft_module(c, f"{layer(i)}.{path}.weight", j)] = (i, path, j, target)
                except UserError:
                    continue
    return out


def in_features(c: ModelConfig, path: str) -> int:
    """The input width of the linear at `path` of a block (`layers.lora.layer_parts`)."""
    return {"attn.qkv": c.hidden, "attn.out": c.num_heads * c.head_dim,
            "mlp.fc1": c.hidden, "mlp.fc2": c.ffn}[path]


def _config(name: str, folder: Path) -> dict:
    where = folder / ADAPTER_CONFIG
    if not folder.is_dir():
        raise UserError(f"--lora {name}: {folder} is not a folder (a PEFT adapter folder: "
                        f"{ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    if not where.is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise UserError(f"--lora {name}: {folder} has no {ADAPTER_CONFIG} and "
                        f"{ADAPTER_WEIGHTS} (a PEFT adapter folder, safetensors)")
    try:
        cfg = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--lora {name}: {where}: not JSON ({e})") from None
    bad = [f"{k}={cfg.get(k)!r}" for k, ok in (
        ("peft_type", cfg.get("peft_type") == "LORA"),
        ("use_dora", not cfg.get("use_dora")), ("bias", cfg.get("bias", "none") == "none"),
        ("fan_in_fan_out", not cfg.get("fan_in_fan_out")),
        ("rank_pattern", not cfg.get("rank_pattern")),
        ("alpha_pattern", not cfg.get("alpha_pattern")),
        ("modules_to_save", not cfg.get("modules_to_save")),
        ("lora_bias", not cfg.get("lora_bias")),
        ("layer_replication", not cfg.get("layer_replication")),
        ("trainable_token_indices", not cfg.get("trainable_token_indices"))) if not ok]
    if bad:
        raise UserError(f"--lora {name}: {where}: {', '.join(bad)}: tpkit serves plain LoRA "
                        f"(peft_type LORA, one r and lora_alpha, no bias, no extra modules)")
    return cfg


def read(name: str, folder: Path, c: ModelConfig) -> Adapter:
    """The adapter in `folder`, checked against the base `c`: one line for a folder that
    is not one, a rank or a target the base cannot take, a tensor of another shape."""
    from safetensors.torch import load_file

    cfg = _config(name, folder)
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not (isinstance(r, int) and 1 <= r <= c.hidden and isinstance(alpha, int | float)):
        raise UserError(f"--lora {name}: r={r!r}, lora_alpha={alpha!r}: r must be an integer "
                        f"in [1, {c.hidden}] (the base's hidden size), lora_alpha a number")
    modules, tensors = _modules(with_family(c)), {}
    parts = {p: dict(named) for p, named in layer_parts(c).items()}
    for key, t in load_file(str(folder / ADAPTER_WEIGHTS)).items():
        module, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
        where = modules.get(module)
        if where is None or kind not in ("A.weight", "B.weight"):
            raise UserError(f"--lora {name}: {key}: not a LoRA factor of a linear layer this "
                            f"base adapts (q, k, v, o, gate, up, down of {c.name})")
        i, path, _, target = where
        shape = (r, in_features(c, path)) if kind[0] == "A" else (parts[path][target], r)
        if tuple(t.shape) != shape:
            raise UserError(f"--lora {name}: {key} is {list(t.shape)}, this base needs "
                            f"{list(shape)} (an adapter of another model?)")
        tensors.setdefault((i, path, target), {})[kind[0]] = t.float()
    half = [k for k, ab in tensors.items() if len(ab) != 2]
    if half or not tensors:
        raise UserError(f"--lora {name}: {folder}: " + (
            f"{layer(half[0][0])}.{half[0][2]} has lora_A or lora_B alone" if half
            else "no LoRA tensors"))
    scale = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return Adapter(name, folder, r, scale, {k: (ab["A"], ab["B"]) for k, ab in tensors.items()})


def read_all(specs: list[str], c: ModelConfig, base: str | None = None) -> list[Adapter]:
    """Every --lora value read and checked (rank 0 first, before any process starts)."""
    named = parse(specs)
    if base is not None and base in (n for n, _ in named):
        raise UserError(f"--lora {base}: the base model's own name (--served-model-name)")
    if named and not c.causal:
        raise UserError("--lora: an encoder serves embeddings; adapters need a model that "
                        "generates")
    return [read(n, f, c) for n, f in named]


class Adapters:
    """The served adapters on this rank, hooked into its model's linear layers
    (`served`); index k >= 1 is `names[k]` (0: the base)."""

    def __init__(self, model: nn.Module, adapters: list[Adapter]) -> None:
        self.names = ["", *(a.name for a in adapters)]
        self.folders = [None, *(a.folder for a in adapters)]
        self.rows: list[tuple[int, torch.Tensor]] | None = None  # the forward's, or None
        c, device = model.config, next(model.parameters()).device
        self.device = device
        for i in range(c.num_layers):
            block = model.layers[str(i)]
            for path, named in layer_parts(c).items():
                linear = block.get_submodule(path)
                factors = {k + 1: tuple(t.to(device) if torch.is_tensor(t) else t for t in f)
                           for k, a in enumerate(adapters)
                           if (f := _factors(linear, a, i, path, [n for n, _ in named]))}
                linear.served = Served(self, factors) if factors else None
            forget(block)  # its native plan picks the hooks up (`NativeLayer`)

    def __len__(self) -> int:
        return len(self.names) - 1

    @contextmanager
    def select(self, pieces):
        """The forward of `pieces` (`decode.paged_kv.Piece`, each its `adapter`) adds each
        row's adapter."""
        by, row = {}, 0
        for p in pieces:
            if p.adapter:
                by.setdefault(p.adapter, []).extend(range(row, row + len(p.tokens)))
            row += len(p.tokens)
        self.rows = [(k, torch.tensor(rows, device=self.device)) for k, rows in by.items()] \
            or None
        try:
            yield
        finally:
            self.rows = None


def _factors(linear: nn.Module, a: Adapter, i: int, path: str, parts: list[str]):
    """(A [R, in_local], B [out_local, R], scale) of adapter `a` on this rank's `linear`
    (its targets side by side: R = r x targets), or None where it adapts none of it."""
    targets = [t for t in parts if (i, path, t) in a.tensors]
    if not targets:
        return None
    rank, tp = linear.group.rank, linear.group.size
    if linear.split.dim == 1:  # row-parallel: A's columns as the base's, B whole
        A, B = a.tensors[(i, path, targets[0])]
        return shard(A, linear.split, rank, tp), B, a.scale
    width, rows = a.rank * len(targets), []
    for j, name in enumerate(parts):  # column-parallel: each part's rows as the base's
        n = linear.split.part_range(j, rank, tp)[1]
        if name not in targets:
            rows.append(torch.zeros(n, width))
            continue
        at = targets.index(name) * a.rank
        b = shard(a.tensors[(i, path, name)][1], part_split(linear.split, j), rank, tp)
        rows.append(F.pad(b, (at, width - at - a.rank)))
    return torch.cat([a.tensors[(i, path, t)][0] for t in targets]), torch.cat(rows), a.scale


class Served:
    """One linear layer's adapters (`linear.served`): `y = served(x, y)` adds the delta
    of each adapted row of the forward (`Adapters.select`) to the base's product y."""

    def __init__(self, adapters: Adapters, factors: dict[int, tuple]) -> None:
        self.adapters, self.factors = adapters, factors

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for k, idx, xr in self._rows(x):
            y.index_add_(0, idx, self._delta(k, xr).to(y.dtype))
        return y

    def _rows(self, x: torch.Tensor):
        for k, idx in self.adapters.rows or ():
            if k in self.factors:
                yield k, idx, x.index_select(0, idx)

    def _delta(self, k: int, x: torch.Tensor) -> torch.Tensor:
        A, B, s = self.factors[k]
        return s * F.linear(F.linear(x.float(), A), B)

    def gated(self, x: torch.Tensor, a: torch.Tensor, product, act) -> torch.Tensor:
        """A fused SwiGLU's output `a` with its adapted rows computed again unfused:
        act(product(x) + delta), product(x) = x W^T + b ([gate; up])."""
        for k, idx, xr in self._rows(x):
            y = product(xr)
            a.index_copy_(0, idx, act(y + self._delta(k, xr).to(y.dtype)))
        return a
