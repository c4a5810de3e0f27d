"""The rank grid: (dp, pp, tp) coordinates, groups and node locality. Pure Python.

    rank = (dp_index * pp + pp_index) * tp + tp_index          tp innermost, dp outermost

    world=8, tp=2, pp=2, dp=2          node 0 (4 GPUs)     node 1 (4 GPUs)
      dp0: pp0 [0 1]  pp1 [2 3]        [0 1 | 2 3]         [4 5 | 6 7]
      dp1: pp0 [4 5]  pp1 [6 7]         tp    tp            tp    tp

Each tensor-parallel group is a run of consecutive ranks, so with torchrun's numbering
(ranks_per_node ranks per node) it stays inside one node whenever tp divides the node.
`ParallelMesh` builds its process groups from these lists; the planner asks the same
functions which link a group runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_KINDS = ("tp", "pp", "dp", "mp")


@dataclass(frozen=True)
class Coord:
    """Where a rank sits in the grid."""

    dp: int
    pp: int
    tp: int


def check_sizes(world_size: int, tp: int, pp: int, dp: int) -> None:
    """Raise ValueError naming the numbers unless tp * pp * dp == world_size."""
    for name, v in (("tp", tp), ("pp", pp), ("dp", dp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if tp * pp * dp != world_size:
        raise ValueError(f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} does not equal "
                         f"world_size={world_size}")


def coord_of(rank: int, tp: int, pp: int) -> Coord:
    """Grid coordinate of a global rank (tp innermost, dp outermost)."""
    return Coord(dp=rank // (tp * pp), pp=(rank // tp) % pp, tp=rank % tp)


def rank_of(c: Coord, tp: int, pp: int) -> int:
    """Global rank at a grid coordinate."""
    return (c.dp * pp + c.pp) * tp + c.tp


def rank_grid(tp: int, pp: int, dp: int) -> list[list[list[int]]]:
    """grid[dp][pp][tp] -> global rank."""
    return [[[rank_of(Coord(d, p, t), tp, pp) for t in range(tp)] for p in range(pp)]
            for d in range(dp)]


def group_ranks(kind: str, tp: int, pp: int, dp: int) -> list[tuple[int, ...]]:
    """Every group of one kind ('tp', 'pp', 'dp' or 'mp' = tp x pp), as rank tuples."""
    g = rank_grid(tp, pp, dp)
    if kind == "tp":
        return [tuple(g[d][p]) for d in range(dp) for p in range(pp)]
    if kind == "pp":
        return [tuple(g[d][p][t] for p in range(pp)) for d in range(dp) for t in range(tp)]
    if kind == "dp":
        return [tuple(g[d][p][t] for d in range(dp)) for p in range(pp) for t in range(tp)]
    if kind == "mp":
        return [tuple(r for p in range(pp) for r in g[d][p]) for d in range(dp)]
    raise ValueError(f"unknown group kind {kind!r}; expected tp, pp, dp or mp")


def nodes_spanned(ranks: tuple[int, ...], ranks_per_node: int) -> int:
    """How many nodes a group touches when each node holds `ranks_per_node` ranks."""
    return len({r // ranks_per_node for r in ranks})


def group_fits_node(span: int, per_node: int) -> bool:
    """A group of `span` consecutive ranks, aligned on multiples of span, stays in one node."""
    return span <= per_node and per_node % span == 0


def locality_problem(tp: int, pp: int, dp: int, ranks_per_node: int) -> str | None:
    """A sentence explaining why the tp groups would cross nodes, or None if they don't."""
    spans = max(nodes_spanned(g, ranks_per_node) for g in group_ranks("tp", tp, pp, dp))
    if spans == 1:
        return None
    return (f"tensor-parallel group of tp={tp} spans {spans} nodes of {ranks_per_node} ranks each: "
            f"tensor parallelism all-reduces the activations 4 times per layer and micro-batch "
            f"(2 forward, 2 backward), which the inter-node network carries at a fraction of "
            f"NVLink's bandwidth and with more latency per message; keep tp <= {ranks_per_node} "
            f"(ranks per node) and use pipeline or data parallelism across nodes")
