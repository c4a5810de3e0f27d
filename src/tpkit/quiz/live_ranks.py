"""What each rank runs for the live demonstrations (module level, so the functions pickle).

Every function takes the rank's `ParallelMesh` first (as `tpkit.launch` passes it) and
returns plain tensors, lists and numbers.
"""

from __future__ import annotations

import time

import torch

from tpkit.comm import all_reduce
from tpkit.layers import ColumnColumnMLP, ParallelMLP, RowParallelLinear


def mlp_weights(mesh, hidden: int, ffn: int) -> dict:
    """This rank's slices of the MLP's two weight matrices."""
    mlp = ParallelMLP(hidden, ffn, mesh.tp_group)
    return dict(fc1=mlp.fc1.weight.detach(), fc2=mlp.fc2.weight.detach())


def mlp_traffic(mesh, x: torch.Tensor, hidden: int, ffn: int) -> dict:
    """Ledger records (op, phase, numel, wire bytes) of a forward+backward of both MLP layouts."""
    out = {}
    for name, cls in (("column_row", ParallelMLP), ("column_column", ColumnColumnMLP)):
        mlp = cls(hidden, ffn, mesh.tp_group)
        mesh.ledger.clear()
        y = mlp(x.clone().requires_grad_(True))  # [b, s, h], x needs a grad as inside a model
        y.sum().backward()
        out[name] = dict(y=y.detach(), records=[(r.op, r.phase, r.numel, r.wire_bytes)
                                                for r in mesh.ledger.records])
    return out


def mlp_partials(mesh, x: torch.Tensor, hidden: int, ffn: int) -> dict:
    """This rank's un-reduced fc2 output, and the all-reduced MLP output with its ledger."""
    mlp = ParallelMLP(hidden, ffn, mesh.tp_group)
    with torch.no_grad():
        partial = mlp.fc2.partial(mlp.act(mlp.fc1(x)))  # [b, s, h], this rank's share
        mesh.ledger.clear()
        y = mlp(x)  # [b, s, h], summed over tp
    return dict(partial=partial, y=y, records=[(r.op, r.phase, r.numel, r.wire_bytes)
                                               for r in mesh.ledger.records])


def row_partials(mesh, y: torch.Tensor, ffn: int, hidden: int) -> dict:
    """Y_r B_r for this rank's rows of B (the input is split here, not reduced)."""
    layer = RowParallelLinear(ffn, hidden, mesh.tp_group, input_is_parallel=False)
    with torch.no_grad():
        return dict(partial=layer.partial(y), weight=list(layer.weight.shape))  # [b, s, h]


def attention_heads(mesh, x: torch.Tensor, hidden: int, heads: int, kv: int) -> dict:
    """Heads this rank owns, its weight shapes, and the attention output."""
    from tpkit.layers.attention import ParallelAttention

    attn = ParallelAttention(hidden, heads, mesh.tp_group, num_kv_heads=kv)
    q, k = attn.owned_heads()
    with torch.no_grad():
        y = attn(x)  # [b, s, h] after one all-reduce
    return dict(q=q, kv=k, qkv=list(attn.qkv.weight.shape), out=list(attn.out.weight.shape), y=y)


def mesh_coords(mesh) -> dict:
    """Where this rank sits in the grid and who its group partners are."""
    c = mesh.coord
    return dict(rank=mesh.rank, coord=(c.dp, c.pp, c.tp), tp=list(mesh.tp_group.ranks),
                pp=list(mesh.pp_group.ranks), dp=list(mesh.dp_group.ranks),
                per_node=mesh.ranks_per_node)


def all_reduce_times(mesh, numel: int, counts: tuple[int, ...]) -> dict[int, float]:
    """Seconds for N back-to-back all-reduces of `numel` floats, for each N in `counts`."""
    g, x = mesh.tp_group, torch.ones(numel)
    for _ in range(3):  # warm-up (connections, buffers)
        all_reduce(x, g)
    out = {}
    for n in counts:
        all_reduce(torch.zeros(1), g)  # line the ranks up
        t0 = time.perf_counter()
        for _ in range(n):
            all_reduce(x, g)
        out[n] = time.perf_counter() - t0
    return out
