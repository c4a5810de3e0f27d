"""The one walk over parts and chunks (`TPSplit.pieces`), the parameter record, flat packing.

A fused qkv weight of a GQA model, 4 query heads and 1 kv head of size 2 at tp=2:
parts (q=8, k=2, v=2) rows, chunks (2, 1, 1): q is split, k and v are replicated.

    rank 0 holds q[0:4], k[0:2], v[0:2]      rank 1 holds q[4:8], k[0:2], v[0:2]
"""

from __future__ import annotations

import pytest
import torch

from tpkit.comm.flat import pack, unpack, unpack_into
from tpkit.layers.sharding import ParamMeta, TPSplit, meta_of, set_meta, shard, unshard
from tpkit.model.names import EMBED_WEIGHT

QKV = TPSplit(0, (8, 2, 2), (2, 1, 1))


def test_pieces_of_a_gqa_qkv_weight():
    got = [(pc.part, pc.chunk, pc.start, pc.local_start, pc.size) for pc in QKV.pieces(1, 2)]
    assert got == [(0, 1, 4, 0, 4), (1, 0, 8, 4, 2), (2, 0, 10, 6, 2)]
    owned = [(r, pc.start, pc.size) for r, pc in QKV.owned_pieces(2)]
    assert owned == [(0, 0, 4), (1, 4, 4), (0, 8, 2), (0, 10, 2)]  # tiles rows 0..11 once


@pytest.mark.parametrize("split,tp", [(QKV, 2), (TPSplit(0, (8, 2, 2), (4, 2, 2)), 4),
                                      (TPSplit.even(1, 12, 3), 3), (TPSplit(0, (6, 6), (2, 2)), 2)])
def test_shard_then_unshard_is_the_identity(split, tp):
    full = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    full = full if split.dim == 0 else full.T.contiguous()  # [12, 5] or [5, 12]
    shards = [shard(full, split, r, tp) for r in range(tp)]
    assert all(s.shape[split.dim] == split.local_size() for s in shards)
    assert torch.equal(unshard(shards, split), full)


def test_shard_names_a_size_that_does_not_match_the_parts():
    with pytest.raises(ValueError, match=r"size 10 along dim 0 .* \[8, 2, 2\] \(sum 12\)"):
        shard(torch.zeros(10, 3), QKV, 0, 2)


def test_parameter_record_defaults_and_updates():
    p = torch.nn.Parameter(torch.zeros(4))
    assert meta_of(p) == ParamMeta()  # replicated, not sequence-parallel, untied
    set_meta(p, split=TPSplit.even(0, 8, 2), logical_size=7)
    set_meta(p, tied_to=EMBED_WEIGHT)
    assert meta_of(p) == ParamMeta(TPSplit.even(0, 8, 2), False, EMBED_WEIGHT, 7)


def test_pack_unpack_round_trip():
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(4.0)
    flat = pack([a, b])  # [10]
    assert flat.tolist() == list(range(6)) + list(range(4))
    assert [t.shape for t in unpack(flat, [a, b])] == [a.shape, b.shape]
    x, y = torch.zeros(2, 3), torch.zeros(4)
    unpack_into(flat * 2, [x, y])
    assert torch.equal(x, a * 2) and torch.equal(y, b * 2)
