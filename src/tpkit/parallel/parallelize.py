"""`parallelize(module, mesh, plan)`: tensor parallelism for a model tpkit has no family for.

    plan = {"embed": "vocab", "*.fc1": "colwise", "*.fc2": "rowwise", "norm": "replicated"}
    model = tpkit.parallelize(model, mesh, plan)   # every tp rank: the same model, same plan

A plan maps module names to styles, as DTensor's `parallelize_module` and Hugging Face's
`tp_plan` do. Each key is an fnmatch pattern over the dotted names of
`module.named_modules()` (`*` crosses dots: "*.fc1" is every fc1); each value a style:

| style      | takes        | becomes                  | this rank holds            | sends               |
|------------|--------------|--------------------------|----------------------------|---------------------|
| colwise    | nn.Linear    | `ColumnParallelLinear`   | out_features / tp rows     | backward: all-reduce of dx |
| rowwise    | nn.Linear    | `RowParallelLinear`      | in_features / tp columns   | forward: all-reduce of y   |
| vocab      | nn.Embedding | `VocabParallelEmbedding` | vocabulary rows / tp (+ pad) | forward: all-reduce of y |
| replicated | any module   | itself                   | every weight               | nothing             |

A colwise layer takes the whole input and leaves its output split along the last
dimension; a rowwise one takes that split input and returns the whole sum: colwise, then
elementwise work, then rowwise sends nothing in between (Megatron's MLP). Every
collective goes through `tpkit.comm` on the mesh's tp group, so `mesh.ledger` counts it.
The module's weights are cut into this rank's shards in place (each rank must hold the
same full weights before, e.g. built from one seed); a plan that cannot work is one
UserError naming the module (or the pattern) and the number.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import nn

from tpkit.comm.group import CommGroup
from tpkit.layers.embedding import VocabParallelEmbedding
from tpkit.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpkit.layers.sharding import materialize, shard, split_of
from tpkit.mesh import ParallelMesh
from tpkit.spec.errors import UserError

STYLES = ("colwise", "rowwise", "vocab", "replicated")
_TAKES = {"colwise": nn.Linear, "rowwise": nn.Linear, "vocab": nn.Embedding}


def parallelize(module: nn.Module, mesh: ParallelMesh | CommGroup, plan: dict[str, str]
                ) -> nn.Module:
    """Swap the planned modules of `module` for tpkit's parallel layers over `mesh`'s tp
    group (a `ParallelMesh`, as `tpkit.spawn` passes, or a `CommGroup`), each holding
    this rank's shard of the weights; returns `module`. Call on every tp rank alike."""
    group = tp_group_of(mesh)
    styles = planned(module, plan)
    tied = _tied(module)
    for name, style in styles.items():
        old = module.get_submodule(name)
        if style != "replicated":
            check_fits(name, old, style, group.size, tied)
    for name, style in styles.items():
        if style != "replicated":
            _replace(module, name, _swap(module.get_submodule(name), style, group))
    return module


def tp_group_of(mesh: ParallelMesh | CommGroup) -> CommGroup:
    """The tp group of a `ParallelMesh`, or the `CommGroup` given."""
    if isinstance(mesh, CommGroup):
        return mesh
    if isinstance(mesh, ParallelMesh):
        return mesh.tp_group
    raise UserError(f"parallelize: mesh is a {type(mesh).__name__}; give the ParallelMesh "
                    f"that tpkit.spawn passes (or ParallelMesh.from_env under torchrun)")


def planned(module: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Module name -> style; a UserError for a style tpkit has not, a pattern that
    matches no module, or a module two patterns give different styles."""
    names = [n for n, _ in module.named_modules() if n]  # the root cannot be swapped
    chosen: dict[str, tuple[str, str]] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise UserError(f"parallelize: plan entry {pattern!r} has style {style!r}, not "
                            f"one of {', '.join(STYLES)}")
        hits = [n for n in names if fnmatchcase(n, pattern)]
        if not hits:
            raise UserError(f"parallelize: plan entry {pattern!r} matches no module of "
                            f"{type(module).__name__} (its modules: {_some(names)})")
        for n in hits:
            before = chosen.setdefault(n, (style, pattern))
            if before[0] != style:
                raise UserError(f"parallelize: {n} is {before[0]} by {before[1]!r} and "
                                f"{style} by {pattern!r}: give it one style")
    return {n: style for n, (style, _) in chosen.items()}


def _some(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most
                                      else "")


def check_fits(name: str, old: nn.Module, style: str, tp: int, tied: dict[int, list[str]]
               ) -> None:
    """A UserError naming `name` when `style` cannot split it over `tp` ranks."""
    want = _TAKES[style]
    if type(old) is not want:
        raise UserError(f"parallelize: {name} is a {type(old).__name__}; {style} takes an "
                        f"nn.{want.__name__}")
    for p_name, p in old.named_parameters(recurse=False):
        if len(tied[id(p)]) > 1:
            raise UserError(f"parallelize: {name}.{p_name} is tied to "
                            f"{', '.join(n for n in tied[id(p)] if n != f'{name}.{p_name}')}"
                            f": a {style} split cannot keep a tied weight")
    if style == "vocab":
        _check_embedding(name, old)
        return
    dim, size = ("out_features", old.out_features) if style == "colwise" else \
        ("in_features", old.in_features)
    if size % tp:
        raise UserError(f"parallelize: {name} ({style}) has {dim}={size}, which tp={tp} "
                        f"does not divide")


def _check_embedding(name: str, old: nn.Embedding) -> None:
    """The options of nn.Embedding the vocab-parallel lookup does not keep."""
    for option, default in (("padding_idx", None), ("max_norm", None),
                            ("scale_grad_by_freq", False), ("sparse", False)):
        if getattr(old, option) != default:
            raise UserError(f"parallelize: {name} has {option}={getattr(old, option)}, which "
                            f"the vocab-parallel embedding does not keep")


def _tied(module: nn.Module) -> dict[int, list[str]]:
    """id of each parameter -> every name it has in `module` (two or more: tied)."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


@torch.no_grad()
def _swap(old: nn.Module, style: str, group: CommGroup) -> nn.Module:
    """tpkit's layer for `old` on `group`, holding this rank's shard of old's weights."""
    kw = dict(device="meta", dtype=old.weight.dtype)
    if style == "vocab":
        new = VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, group, **kw)
        pad = new.padded_vocab - old.num_embeddings  # zero rows no id reaches
        full = {"weight": torch.cat([old.weight, old.weight.new_zeros(pad, new.hidden)])}
    else:
        cls = ColumnParallelLinear if style == "colwise" else RowParallelLinear
        new = cls(old.in_features, old.out_features, group, bias=old.bias is not None, **kw)
        full = dict(old.named_parameters(recurse=False))
    materialize(new, old.weight.device)
    for n, p in new.named_parameters(recurse=False):
        split = split_of(p)
        p.copy_(full[n] if split is None else shard(full[n], split, group.rank, group.size))
        p.requires_grad_(getattr(old, n).requires_grad)
    return new.train(old.training)


def _replace(module: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent), child, new)
