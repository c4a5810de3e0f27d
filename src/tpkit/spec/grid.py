"""The rank grid: (dp, pp, cp, tp) coordinates, groups and node locality. Pure Python.

    rank = ((dp_index * pp + pp_index) * cp + cp_index) * tp + tp_index
                                        tp innermost, then cp, then pp, dp outermost

    world=8, tp=2, pp=2, dp=2 (cp=1)   node 0 (4 GPUs)     node 1 (4 GPUs)
      dp0: pp0 [0 1]  pp1 [2 3]        [0 1 | 2 3]         [4 5 | 6 7]
      dp1: pp0 [4 5]  pp1 [6 7]         tp    tp            tp    tp

    world=8, tp=2, cp=2, dp=2           tp groups (0 1) (2 3) (4 5) (6 7)
      dp0: cp0 [0 1]  cp1 [2 3]         cp groups (0 2) (1 3) (4 6) (5 7)
      dp1: cp0 [4 5]  cp1 [6 7]         dp groups (0 4) (1 5) (2 6) (3 7)

Each tensor-parallel group is a run of consecutive ranks, so with torchrun's numbering
(ranks_per_node ranks per node) it stays inside one node whenever tp divides the node.
The context-parallel ring (k/v of every layer, every micro-batch) comes next, before
the pipeline: its ranks are tp apart. The ranks that hold the same weights, and average
their gradients, are the dp x cp group (`replica_ranks`): the same (pp, tp) coordinate.
`ParallelMesh` builds its process groups from these lists; the planner asks the same
functions which link a group runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_KINDS = ("tp", "cp", "pp", "dp", "dp_cp", "mp")


@dataclass(frozen=True)
class Coord:
    """Where a rank sits in the grid."""

    dp: int
    pp: int
    tp: int
    cp: int = 0


def world_of(tp: int, pp: int, dp: int, cp: int = 1) -> int:
    """How many ranks the grid holds: tp * pp * dp * cp."""
    return tp * pp * dp * cp


def weight_replicas(dp: int, cp: int = 1) -> int:
    """Ranks that hold the same weights and average their gradients: dp x cp."""
    return dp * cp


def dp_left(world_size: int, tp: int, pp: int, cp: int = 1) -> int | None:
    """The dp that `world_size` ranks leave over for tp x pp x cp, or None if it does
    not divide them."""
    rest = world_of(tp, pp, 1, cp)
    return world_size // rest if world_size % rest == 0 else None


def check_sizes(world_size: int, tp: int, pp: int, dp: int, cp: int = 1) -> None:
    """Raise ValueError naming the numbers unless tp * pp * dp * cp == world_size."""
    for name, v in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    n = world_of(tp, pp, dp, cp)
    if n != world_size:
        said = f"tp*pp*dp = {tp}*{pp}*{dp}" if cp == 1 else f"tp*pp*dp*cp = {tp}*{pp}*{dp}*{cp}"
        raise ValueError(f"{said} = {n} does not equal world_size={world_size}")


def coord_of(rank: int, tp: int, pp: int, cp: int = 1) -> Coord:
    """Grid coordinate of a global rank (tp innermost, then cp, pp, dp outermost)."""
    return Coord(dp=rank // (tp * cp * pp), pp=(rank // (tp * cp)) % pp, tp=rank % tp,
                 cp=(rank // tp) % cp)


def rank_of(c: Coord, tp: int, pp: int, cp: int = 1) -> int:
    """Global rank at a grid coordinate."""
    return ((c.dp * pp + c.pp) * cp + c.cp) * tp + c.tp


def rank_grid(tp: int, pp: int, dp: int, cp: int = 1) -> list:
    """grid[dp][pp][tp] -> global rank (cp=1), or grid[dp][pp][cp][tp] with cp > 1."""
    def cell(d: int, p: int):
        rows = [[rank_of(Coord(d, p, t, c), tp, pp, cp) for t in range(tp)] for c in range(cp)]
        return rows[0] if cp == 1 else rows

    return [[cell(d, p) for p in range(pp)] for d in range(dp)]


def replica_ranks(c: Coord, tp: int, pp: int, dp: int, cp: int = 1) -> tuple[int, ...]:
    """The dp x cp group of coordinate `c`: every rank holding the same weights (the same
    (pp, tp)), in order replica * cp + cp_index (the order gradients are reduced in)."""
    return tuple(rank_of(Coord(d, c.pp, c.tp, k), tp, pp, cp) for d in range(dp)
                 for k in range(cp))


def group_ranks(kind: str, tp: int, pp: int, dp: int, cp: int = 1) -> list[tuple[int, ...]]:
    """Every group of one kind, as rank tuples: 'tp', 'cp', 'pp', 'dp' (one rank per
    replica), 'dp_cp' (`replica_ranks`: the ranks that average gradients) or 'mp'
    (tp x pp: one model replica's stages at one cp index)."""
    cells = [Coord(d, p, t, k) for d in range(dp) for p in range(pp) for k in range(cp)
             for t in range(tp)]

    def along(dim: str) -> list[tuple[int, ...]]:
        sizes = dict(tp=tp, cp=cp, pp=pp, dp=dp)
        heads = [c for c in cells if getattr(c, dim) == 0]
        return [tuple(rank_of(Coord(**{**vars(c), dim: i}), tp, pp, cp)
                      for i in range(sizes[dim])) for c in heads]

    if kind in ("tp", "cp", "pp", "dp"):
        return along(kind)
    if kind == "dp_cp":
        return [replica_ranks(c, tp, pp, dp, cp) for c in cells if c.dp == 0 and c.cp == 0]
    if kind == "mp":
        return [tuple(rank_of(Coord(c.dp, p, t, c.cp), tp, pp, cp) for p in range(pp)
                      for t in range(tp)) for c in cells if c.pp == 0 and c.tp == 0]
    raise ValueError(f"unknown group kind {kind!r}; expected one of {', '.join(GROUP_KINDS)}")


def tied_pairs(tp: int, pp: int, dp: int, cp: int = 1) -> list[tuple[int, int]]:
    """(first stage, last stage) rank pairs at each (dp, cp, tp): a tied embedding's copies."""
    return [(rank_of(Coord(d, 0, t, k), tp, pp, cp), rank_of(Coord(d, pp - 1, t, k), tp, pp, cp))
            for d in range(dp) for k in range(cp) for t in range(tp)]


def group_stride(kind: str, tp: int, pp: int, cp: int = 1) -> int:
    """How many ranks apart the neighbours of a 'tp', 'cp', 'pp' or 'dp' group sit."""
    return dict(tp=1, cp=tp, pp=tp * cp, dp=tp * cp * pp)[kind]


def nodes_spanned(ranks: tuple[int, ...], ranks_per_node: int) -> int:
    """How many nodes a group touches when each node holds `ranks_per_node` ranks."""
    return len({r // ranks_per_node for r in ranks})


def group_fits_node(span: int, per_node: int) -> bool:
    """A group of `span` consecutive ranks, aligned on multiples of span, stays in one node."""
    return span <= per_node and per_node % span == 0


def locality_problem(tp: int, pp: int, dp: int, ranks_per_node: int, cp: int = 1) -> str | None:
    """A sentence explaining why the tp groups would cross nodes, or None if they don't."""
    spans = max(nodes_spanned(g, ranks_per_node) for g in group_ranks("tp", tp, pp, dp, cp))
    if spans == 1:
        return None
    return (f"tensor-parallel group of tp={tp} spans {spans} nodes of {ranks_per_node} ranks each: "
            f"tensor parallelism all-reduces the activations 4 times per layer and micro-batch "
            f"(2 forward, 2 backward), which the inter-node network carries at a fraction of "
            f"NVLink's bandwidth and with more latency per message; keep tp <= {ranks_per_node} "
            f"(ranks per node) and use pipeline or data parallelism across nodes")
