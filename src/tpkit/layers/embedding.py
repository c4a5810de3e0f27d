"""Vocab-parallel embedding (Shoeybi et al. 2019, section 3).

    vocabulary rows [V_pad, h] split over tp:   rank r owns ids [r*V_pad/tp, (r+1)*V_pad/tp)
    each rank looks up the ids it owns, writes zeros for the others,
    one all-reduce sums the partial lookups: every id was found on exactly one rank.
    (With sequence parallelism: one reduce-scatter, leaving [b, s/tp, h].)

The vocabulary is padded with zero rows so that each rank holds a multiple of 8 rows
(aligned GEMMs); padded ids never occur and padded logits are kept out of the softmax
by the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.comm import ops
from tpkit.comm.group import CommGroup
from tpkit.layers.sharding import TPSplit, master_normal, set_meta, shard
from tpkit.spec.errors import UserError
from tpkit.spec.shapes import padded_vocab


def padded_master(vocab: int, padded: int, hidden: int, std: float, seed: int) -> torch.Tensor:
    """The full [V_pad, h] table: the tp=1 draw of [V, h], then zero rows up to V_pad."""
    full = master_normal((vocab, hidden), std, seed)
    return torch.cat([full, full.new_zeros(padded - vocab, hidden)]) if padded > vocab else full


def check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """A UserError when an id is outside [0, vocab_size): every tp rank sees the same
    batch, so each raises alike, before the all-reduce (no collective, one min/max). At
    tp > 1 the masked lookup would otherwise embed an unknown id as a silent zero."""
    if ids.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one read back
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise UserError(f"token id {bad} is outside the model's vocabulary "
                        f"(vocab_size={vocab_size}): the data or prompt was tokenized for "
                        f"another model")


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split over tp."""

    def __init__(self, vocab_size: int, hidden: int, group: CommGroup, *,
                 sequence_parallel: bool = False, init_std: float = 0.02, seed: int = 0,
                 device=None, dtype=None) -> None:
        super().__init__()
        tp = group.size
        self.vocab_size, self.hidden, self.group = vocab_size, hidden, group
        self.padded_vocab = padded_vocab(vocab_size, tp)
        self.per_rank = self.padded_vocab // tp
        self.vocab_start = group.rank * self.per_rank
        self.sequence_parallel, self.init_std, self.seed = sequence_parallel, init_std, seed
        self.split = TPSplit.even(0, self.padded_vocab)
        # rows past vocab_size are padding (checkpoints drop them)
        self.weight = set_meta(nn.Parameter(torch.empty(self.per_rank, hidden, device=device,
                                                        dtype=dtype)),
                               split=self.split, logical_size=vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The tp=1 table drawn from `seed`, padded, and this rank's rows kept."""
        if self.weight.is_meta:
            return
        full = padded_master(self.vocab_size, self.padded_vocab, self.hidden, self.init_std,
                             self.seed)
        with torch.no_grad():
            self.weight.copy_(shard(full, self.split, self.group.rank, self.group.size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> [b, s, h] (or [b, s/tp, h] with sequence parallelism)."""
        check_ids(ids, self.vocab_size)
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start  # [b, s]
        outside = (local < 0) | (local >= self.per_rank)  # ids other ranks own
        y = F.embedding(local.masked_fill(outside, 0), self.weight)  # [b, s, h]
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return ops.reduce_scatter_to_sp(y, self.group)  # [b, s/tp, h]
        return ops.reduce_from_tp(y, self.group)  # [b, s, h]

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab}, {self.per_rank} per rank), "
                f"hidden={self.hidden}, tp={self.group.size}, sp={self.sequence_parallel}")
