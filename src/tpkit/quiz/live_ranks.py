"""What each rank runs for the live demonstrations (module level, so the functions pickle).

Every function takes the rank's `ParallelMesh` first (as `tpkit.launch` passes it) and
returns plain tensors, lists and numbers.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tpkit.comm import all_reduce, ops
from tpkit.layers import ColumnColumnMLP, ParallelMLP, RowParallelLinear
from tpkit.layers.attention import ParallelAttention
from tpkit.layers.cross_entropy import vocab_parallel_cross_entropy
from tpkit.layers.embedding import VocabParallelEmbedding
from tpkit.spec.config import ModelConfig


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
    attn = ParallelAttention(ModelConfig(hidden=hidden, num_heads=heads, kv_heads=kv),
                             mesh.tp_group)
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


def all_reduce_times(mesh, numel: int, counts: tuple[int, ...], repeats: int = 9,
                     warmup: int = 5) -> dict:
    """Seconds for N back-to-back all-reduces of `numel` floats, for each N in `counts`,
    `repeats` times each (after `warmup` unmeasured ones), interleaved so that load on
    the machine hits every N alike; and how many all-reduces the ledger saw. When the
    group talks through shared memory (ranks of one "node"), the largest N again over
    the same ranks' loopback TCP (gloo: what links two "nodes") as `tcp_times`."""
    g, x = mesh.tp_group, torch.ones(numel)
    out = _sequences(g, x, counts, repeats, warmup)
    ledger = sum(r.op == "all_reduce" for r in mesh.ledger.records)
    tcp = None
    if g.shm is not None:
        with mesh.ledger.paused():
            tcp = _sequences(dataclasses.replace(g, shm=None), x, counts[-1:], repeats, warmup)
    return dict(times=out, tcp_times=tcp, ledger=ledger)


def _sequences(g, x: torch.Tensor, counts: tuple[int, ...], repeats: int, warmup: int
               ) -> dict[int, list[float]]:
    for _ in range(warmup):  # connections, buffers, first-call paths
        all_reduce(x, g)
    out: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(repeats):
        for n in counts:
            all_reduce(torch.zeros(1), g)  # line the ranks up
            t0 = time.perf_counter()
            for _ in range(n):
                all_reduce(x, g)
            out[n].append(time.perf_counter() - t0)
    return out


# -- level 2 ------------------------------------------------------------------------------
def _records(mesh) -> list[tuple]:
    return [(r.op, r.phase, r.numel, r.wire_bytes) for r in mesh.ledger.records]


def sp_traffic(mesh, x: torch.Tensor, hidden: int, ffn: int) -> dict:
    """Ledger of a forward+backward of the MLP without and with sequence parallelism
    (then the input is this rank's slice of the sequence, [b, s/tp, h])."""
    out = {}
    for name, sp in (("plain", False), ("sp", True)):
        mlp = ParallelMLP(hidden, ffn, mesh.tp_group, sequence_parallel=sp)
        xin = ops.scatter_to_sp(x, mesh.tp_group) if sp else x  # [b, s/tp, h] or [b, s, h]
        mesh.ledger.clear()
        y = mlp(xin.detach().clone().requires_grad_(True))  # [b, s(/tp), h]
        y.sum().backward()
        out[name] = dict(y=y.detach(), records=_records(mesh))
    return out


def vocab_parallel_traffic(mesh, logits: torch.Tensor, target: torch.Tensor,
                           ids: torch.Tensor, hidden: int) -> dict:
    """This rank's vocab slice of the logits -> per-token loss (3 small all-reduces), and
    a vocab-parallel embedding lookup (1 all-reduce), each with its ledger."""
    tp, r, vocab = mesh.tp_size, mesh.tp_rank, logits.shape[-1]
    local = logits[..., r * vocab // tp:(r + 1) * vocab // tp]  # [b, s, V/tp]
    with torch.no_grad():
        mesh.ledger.clear()
        loss = vocab_parallel_cross_entropy(local, target, mesh.tp_group, vocab)  # [b, s]
        ce = _records(mesh)
        mesh.ledger.clear()
        emb = VocabParallelEmbedding(vocab, hidden, mesh.tp_group)(ids)  # [b, s, h]
    return dict(loss=loss, ce=ce, emb=emb, emb_records=_records(mesh))


def ring_all_reduce(mesh, numel: int) -> dict:
    """One all-reduce of `numel` floats and its ledger record (wire bytes of a ring)."""
    x = torch.ones(numel)
    mesh.ledger.clear()
    all_reduce(x, mesh.tp_group)
    return dict(records=_records(mesh), value=float(x[0]))


def row_bias(mesh, y: torch.Tensor, ffn: int, hidden: int, bias: float) -> dict:
    """A row-parallel layer with a non-zero bias: this rank's partial product and the
    layer's output (bias added once, after the all-reduce)."""
    layer = RowParallelLinear(ffn, hidden, mesh.tp_group, input_is_parallel=False)
    with torch.no_grad():
        layer.bias.fill_(bias)
        return dict(partial=layer.partial(y), z=layer(y), bias=layer.bias.clone())  # [b, s, h]
