"""How a tensor-parallel parameter is split along one dimension: which rows each rank
owns, even or not. Pure Python (the layers tag their parameters with it, checkpoints,
resharding and Hugging Face import read it, the planner sizes ranks by it).

A split is along one `dim`, in logical `parts` (a fused gate+up weight has two parts,
a fused qkv weight three). Part i is `units[i]` units wide (heads: head_dim rows
each; columns of the MLP: one row each), dealt over tp ranks by
`tpkit.spec.shapes.even_range`: as evenly as possible, the first ranks one unit more.
A part with `reads[i] > 0` holds grouped-query kv heads instead: each rank holds the
kv heads its query heads (`reads[i]` of them, dealt evenly) read, and a kv head read
by several ranks is held by each of them (its gradient is summed over them).

    9 heads, 3 kv heads of 8 rows at tp=2: TPSplit(0, (72, 24, 24), (9, 3, 3), (0, 9, 9))
      rank 0: q rows 0..39  (heads 0-4)   k, v rows 0..15 (kv 0-1)
      rank 1: q rows 40..71 (heads 5-8)   k, v rows 8..23 (kv 1-2): kv 1 on both ranks

`pieces(rank, tp)` is the one walk over what a rank holds: sharding, unsharding,
checkpoint reads, gradient sums and norms all use it. A piece never straddles rows
held by different sets of ranks, so `holders` says how many ranks hold it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from tpkit.spec.shapes import even_range, kv_range


@dataclass(frozen=True)
class Piece:
    """A run of rows of one logical part, as a rank holds it (offsets along the dim)."""

    part: int  # which logical part
    part_start: int  # where the part starts in the global tensor
    start: int  # where these rows start in the global tensor
    local_start: int  # where they start in the rank's shard
    size: int  # how many rows
    holders: int  # how many tp ranks hold these rows (> 1: their gradient is summed)


@dataclass(frozen=True)
class TPSplit:
    """A tensor split along `dim` into logical `parts`, part i dealt in `units[i]` units
    over tp (or, with `reads[i]` > 0, as the kv heads that many query heads read).
    `units` None: every row is a unit; `reads` None: no kv part."""

    dim: int
    parts: tuple[int, ...]
    units: tuple[int, ...] | None = None
    reads: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        object.__setattr__(self, "units", tuple(self.units or self.parts))
        object.__setattr__(self, "reads", tuple(self.reads or (0,) * len(self.parts)))

    @classmethod
    def even(cls, dim: int, size: int, units: int | None = None) -> TPSplit:
        """One part of `size` rows in `units` units (None: rows), dealt over tp."""
        return cls(dim, (size,), (units or size,))

    @classmethod
    def heads(cls, num_heads: int, kv_heads: int, head_dim: int) -> TPSplit:
        """The fused [q; k; v] rows of an attention layer (dim 0)."""
        q, kv = num_heads * head_dim, kv_heads * head_dim
        return cls(0, (q, kv, kv), (num_heads, kv_heads, kv_heads), (0, num_heads, num_heads))

    def problems(self, tp: int) -> list[str]:
        """Why the parts cannot be dealt over tp ranks as declared (empty: they can)."""
        out = []
        for size, n, q in zip(self.parts, self.units, self.reads):
            if n < 1 or size % n:
                out.append(f"a part of size {size} is not {n} units of equal width")
            elif q and (q % n or q < tp):
                out.append(f"{n} kv heads cannot serve {q} query heads over tp={tp}")
            elif not q and n < tp:
                out.append(f"{n} units of size {size // n} cannot be dealt over tp={tp} "
                           f"(each rank needs one at least)")
        return out

    def check(self, tp: int, what: str = "parameter") -> None:
        """ValueError naming the numbers unless every part can be dealt over tp."""
        if self.problems(tp):
            raise ValueError(f"{what}: " + "; ".join(self.problems(tp)))

    def part_range(self, part: int, rank: int, tp: int) -> tuple[int, int]:
        """(offset in the part, rows) of part `part` that `rank` of `tp` holds."""
        size, n, q = self.parts[part], self.units[part], self.reads[part]
        a, k = kv_range(q, n, tp, rank) if q else even_range(n, tp, rank)
        w = size // n
        return a * w, k * w

    def local_size(self, rank: int, tp: int) -> int:
        """Size along `dim` that `rank` of `tp` holds."""
        return sum(self.part_range(i, rank, tp)[1] for i in range(len(self.parts)))

    def even_over(self, tp: int) -> bool:
        """Whether every rank holds the same rows count (tp divides every part alike)."""
        return len({self.local_size(r, tp) for r in range(tp)}) == 1

    def part_shared(self, part: int, tp: int) -> bool:
        """Whether some rows of `part` are held by several ranks (the same on every rank)."""
        return part in _shared_parts(self, tp)

    def shared(self, tp: int) -> bool:
        """True when some rows are held by several ranks (their gradient needs a sum)."""
        return bool(_shared_parts(self, tp))

    def pieces(self, rank: int, tp: int) -> Iterator[Piece]:
        """What rank `rank` of `tp` holds, part by part, in the order of its shard."""
        return iter(_pieces(self, rank, tp))

    def owned_pieces(self, tp: int) -> list[tuple[int, Piece]]:
        """Every run of rows once, in global order, with the lowest rank that holds it."""
        first: dict[int, tuple[int, Piece]] = {}
        for rank in range(tp):
            for pc in self.pieces(rank, tp):
                first.setdefault(pc.start, (rank, pc))
        return [first[k] for k in sorted(first)]

    def to_json(self) -> dict:
        """Plain JSON (a checkpoint's manifest)."""
        return dict(dim=self.dim, parts=list(self.parts), units=list(self.units),
                    reads=list(self.reads))

    @classmethod
    def from_json(cls, d: dict, tp: int) -> TPSplit:
        """Inverse of `to_json`; also reads the manifests written before uneven splits,
        whose part i was cut in `chunks[i]` equal chunks (< tp: shared by tp/chunks
        ranks), as saved at `tp`."""
        if "chunks" in d:
            chunks = tuple(d["chunks"])
            return cls(d["dim"], tuple(d["parts"]), chunks,
                       tuple(0 if n == tp else tp for n in chunks))
        return cls(d["dim"], tuple(d["parts"]), tuple(d["units"]), tuple(d["reads"]))


@lru_cache(maxsize=4096)
def _pieces(split: TPSplit, rank: int, tp: int) -> tuple[Piece, ...]:
    out, part_start, local_start = [], 0, 0
    for i, size in enumerate(split.parts):
        ranges = [split.part_range(i, r, tp) for r in range(tp)]
        a, k = ranges[rank]
        cuts = sorted({a, a + k} | {x for s, n in ranges for x in (s, s + n) if a < x < a + k})
        for lo, hi in zip(cuts, cuts[1:]):
            holders = sum(1 for s, n in ranges if s <= lo and hi <= s + n)
            out.append(Piece(i, part_start, part_start + lo, local_start + lo - a, hi - lo,
                             holders))
        part_start, local_start = part_start + size, local_start + k
    return tuple(out)


@lru_cache(maxsize=4096)
def _shared_parts(split: TPSplit, tp: int) -> frozenset[int]:
    return frozenset(pc.part for r in range(tp) for pc in _pieces(split, r, tp) if pc.holders > 1)
