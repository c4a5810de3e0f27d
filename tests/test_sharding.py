"""The one walk over what a rank holds (`TPSplit.pieces`), the parameter record, flat packing.

A fused qkv weight of a GQA model, 2 query heads and 1 kv head of size 4/2 at tp=2:
parts (q=8, k=2, v=2) rows, units (2, 1, 1), the kv unit read by the 2 query units:
q is split, k and v are replicated.

    rank 0 holds q[0:4], k[0:2], v[0:2]      rank 1 holds q[4:8], k[0:2], v[0:2]

Uneven: 9 heads / 3 kv heads at tp=2 deal 5 + 4 query heads, kv 0-1 and kv 1-2.
"""

from __future__ import annotations

import pytest
import torch

from tpkit.comm.flat import pack, unpack, unpack_into
from tpkit.layers.sharding import ParamMeta, TPSplit, meta_of, set_meta, shard, unshard
from tpkit.model.names import EMBED_WEIGHT
from tpkit.spec.shapes import even_range, kv_range

QKV = TPSplit.heads(2, 1, 4)


def test_pieces_of_a_gqa_qkv_weight():
    assert QKV == TPSplit(0, (8, 4, 4), (2, 1, 1), (0, 2, 2))
    got = [(pc.part, pc.start, pc.local_start, pc.size, pc.holders) for pc in QKV.pieces(1, 2)]
    assert got == [(0, 4, 0, 4, 1), (1, 8, 4, 4, 2), (2, 12, 8, 4, 2)]
    owned = [(r, pc.start, pc.size) for r, pc in QKV.owned_pieces(2)]
    assert owned == [(0, 0, 4), (1, 4, 4), (0, 8, 4), (0, 12, 4)]  # tiles rows 0..15 once


def test_even_range_deals_the_first_ranks_one_more():
    assert [even_range(9, 2, r) for r in range(2)] == [(0, 5), (5, 4)]
    assert [even_range(14, 4, r)[1] for r in range(4)] == [4, 4, 3, 3]
    assert [even_range(1536, 5, r)[1] for r in range(5)] == [308, 307, 307, 307, 307]
    assert [even_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]


def test_kv_heads_follow_the_query_heads_that_read_them():
    """9 heads / 3 kv at tp=2: q 0-4 | 5-8, kv 0-1 | 1-2 (query 3, 4 read kv 1, so does 5);
    14 / 2 at tp=4: q 0-3 | 4-7 | 8-10 | 11-13, kv 0 | 0-1 | 1 | 1."""
    assert [kv_range(9, 3, 2, r) for r in range(2)] == [(0, 2), (1, 2)]
    assert [kv_range(14, 2, 4, r) for r in range(4)] == [(0, 1), (0, 2), (1, 1), (1, 1)]
    assert [kv_range(8, 2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_range(32, 8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    split = TPSplit.heads(9, 3, 8)  # k rows 72..95: kv 1 (rows 80..87) on both ranks
    assert [(pc.start, pc.size, pc.holders) for pc in split.pieces(1, 2)] == [
        (40, 32, 1), (80, 8, 2), (88, 8, 1), (104, 8, 2), (112, 8, 1)]
    assert [split.local_size(r, 2) for r in range(2)] == [40 + 32, 32 + 32]
    assert split.shared(2) and not TPSplit.heads(9, 3, 8).shared(3)


@pytest.mark.parametrize("split,tp", [(QKV, 2), (TPSplit(0, (8, 2, 2), (4, 2, 2), (0, 4, 4)), 4),
                                      (TPSplit.even(1, 12, 3), 3), (TPSplit(0, (6, 6)), 2),
                                      (TPSplit.heads(3, 1, 2), 2), (TPSplit.heads(3, 3, 2), 2),
                                      (TPSplit(0, (5, 7)), 3), (TPSplit.even(1, 12, 4), 3)])
def test_shard_then_unshard_is_the_identity(split, tp):
    n = sum(split.parts)
    full = torch.arange(n * 5, dtype=torch.float32).reshape(n, 5)
    full = full if split.dim == 0 else full.T.contiguous()  # [n, 5] or [5, n]
    shards = [shard(full, split, r, tp) for r in range(tp)]
    assert [s.shape[split.dim] for s in shards] == [split.local_size(r, tp) for r in range(tp)]
    assert torch.equal(unshard(shards, split), full)


def test_split_json_reads_the_manifests_of_even_chunks():
    """A manifest written before uneven splits names `chunks` (< tp: shared by tp/chunks
    ranks); read at its tp, it is the same layout."""
    old = dict(dim=0, parts=[64, 16, 16], chunks=[4, 2, 2])
    split = TPSplit.from_json(old, tp=4)
    assert split == TPSplit(0, (64, 16, 16), (4, 2, 2), (0, 4, 4))
    assert [list(split.pieces(r, 4)) for r in range(4)] == [
        list(TPSplit.heads(8, 2, 8).pieces(r, 4)) for r in range(4)]
    new = TPSplit.heads(9, 3, 8)
    assert TPSplit.from_json(new.to_json(), tp=2) == new


def test_a_part_smaller_than_tp_is_named():
    assert TPSplit.even(0, 3).problems(4) == [
        "3 units of size 1 cannot be dealt over tp=4 (each rank needs one at least)"]
    with pytest.raises(ValueError, match="a part of size 10 is not 4 units"):
        TPSplit(0, (10,), (4,)).check(2, "x")


def test_shard_names_a_size_that_does_not_match_the_parts():
    with pytest.raises(ValueError, match=r"size 10 along dim 0 .* \[8, 4, 4\] \(sum 16\)"):
        shard(torch.zeros(10, 3), QKV, 0, 2)


def test_parameter_record_defaults_and_updates():
    p = torch.nn.Parameter(torch.zeros(4))
    assert meta_of(p) == ParamMeta()  # replicated, not sequence-parallel, untied
    set_meta(p, split=TPSplit.even(0, 8), logical_size=7)
    set_meta(p, tied_to=EMBED_WEIGHT)
    assert meta_of(p) == ParamMeta(TPSplit.even(0, 8), False, EMBED_WEIGHT, 7)


def test_pack_unpack_round_trip():
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(4.0)
    flat = pack([a, b])  # [10]
    assert flat.tolist() == list(range(6)) + list(range(4))
    assert [t.shape for t in unpack(flat, [a, b])] == [a.shape, b.shape]
    x, y = torch.zeros(2, 3), torch.zeros(4)
    unpack_into(flat * 2, [x, y])
    assert torch.equal(x, a * 2) and torch.equal(y, b * 2)
