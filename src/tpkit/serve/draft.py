"""Draft-model speculative decoding (`--speculative draft --draft-checkpoint PATH`):

    spec = DraftSpeculator(draft_model, tokens=4)   # Engine(target, ..., speculator=spec)

A smaller model with the target's vocabulary proposes each sequence's next k tokens
greedily (k one-token steps after catching up with the tokens it has not seen), and
the target verifies them as `serve.speculate` verifies n-gram proposals (the same rows,
rejection rule, rollback, backoff, cost rule and metrics): the output is the target's,
token for token, whatever the draft proposes. The draft runs on rank 0 alone at tp=1
(as vLLM's draft_tensor_parallel_size=1), the target at any tp; its own paged KV cache
holds, per sequence, the keys of the tokens it has computed. Its rollback is implicit:
before proposing, the draft keeps the longest prefix of what it computed that the
sequence's tokens still begin with (the proposals the target rejected are dropped
there) and computes from there, so a rejected proposal's keys are simply written over.
A greedy draft's proposal is one token with certainty (a point mass): the rejection
rule for sampled requests is then the target's own draw (`serve.speculate`).
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.decode.paged_kv import LAST, PagedCache, Piece, forward
from tpkit.mesh import ParallelMesh
from tpkit.serve.blocks import BlockPool
from tpkit.serve.speculate import Speculator
from tpkit.spec.errors import UserError
from tpkit.spec.speculative import TOKENS
from tpkit.weights.sources import load_model, open_source, source_tokenizer
from tpkit.weights.tokenizer import load_tokenizer

BLOCK_SIZE = 16


def check_vocabulary(target: nn.Module, draft: nn.Module, target_tok=None,
                     draft_tok=None) -> None:
    """UserError unless `draft` shares `target`'s vocabulary (its size, and the token
    strings where both have tokenizers)."""
    t, d = target.config.vocab_size, draft.config.vocab_size
    if t != d:
        raise UserError(f"--draft-checkpoint: the draft's vocabulary has {d} tokens, the "
                        f"target's {t}: a draft needs the target's tokenizer")
    probe = "Draft models must share the tokenizer: 0123 ünïcode, {json}\n"
    if target_tok is not None and draft_tok is not None and \
            target_tok.encode(probe) != draft_tok.encode(probe):
        raise UserError("--draft-checkpoint: the draft's tokenizer encodes text differently "
                        "from the target's: a draft needs the target's tokenizer")


class Draft:
    """The draft model and its paged KV cache: per sequence, the tokens whose keys it
    holds and its block table."""

    def __init__(self, model: nn.Module, sequences: int = 8, max_len: int = 2048) -> None:
        if model.group.size != 1:
            raise UserError(f"the draft model runs at tp=1 (its mesh has tp="
                            f"{model.group.size})")
        self.model = model.eval()
        self.max_len = min(max_len, model.config.max_seq_len)
        self.cache = PagedCache(model, BLOCK_SIZE)
        self.pool = BlockPool(BLOCK_SIZE, sequences * -(-self.max_len // BLOCK_SIZE) + 1,
                              caching=False)
        self.seqs: dict[int, tuple[list[int], list[int]]] = {}  # id -> (tokens, blocks)

    def keep(self, alive: set[int]) -> None:
        """Free the blocks of the sequences not in `alive` (finished or preempted)."""
        for rid in [i for i in self.seqs if i not in alive]:
            self.pool.release(self.seqs.pop(rid)[1])

    def propose(self, rid: int, ctx: list[int], k: int) -> list[int]:
        """The draft's k greedy tokens after `ctx` (sequence `rid`'s tokens); fewer
        (possibly none) where its context or cache runs out."""
        k = min(k, self.max_len - len(ctx))
        if k <= 0:
            return []
        done, blocks = self.seqs.setdefault(rid, ([], []))
        n = next((i for i, (a, b) in enumerate(zip(done, ctx)) if a != b),
                 min(len(done), len(ctx)))
        n = min(n, len(ctx) - 1)  # at least one token to compute: its logits
        del done[n:]
        need = -(-(len(ctx) + k - 1) // BLOCK_SIZE) - len(blocks)
        if need > 0:
            more = self.pool.allocate(need)
            if more is None:
                return []
            blocks += more
            self.cache.grow(self.pool.size)
        out, feed = [], ctx[n:]
        for _ in range(k):
            last, _ = forward(self.model, self.cache,
                              [Piece(feed, len(done), blocks, LAST)], greedy=True)
            done += feed
            feed = [int(last[0, 0])]
            out += feed
        return out


class DraftSpeculator(Speculator):
    """`serve.speculate.Speculator` whose proposals come from a `Draft` model."""

    free_lookups = False  # a lookup is the draft's forwards: only for tokens proposed

    def __init__(self, draft: Draft, tokens: int = TOKENS, rows: int = 8,
                 row_cost: float | None = None) -> None:
        super().__init__(tokens, rows, row_cost)
        self.draft = draft

    def propose(self, decodes: list, spare: int, room) -> dict[int, list[int]]:
        """`Speculator.propose`, the draft's cache freed of finished sequences first."""
        self.draft.keep({r.id for r in decodes})
        return super().propose(decodes, spare, room)

    def lookup(self, st, req, k: int) -> list[int]:
        """The draft's k greedy tokens after `req`'s prompt and output."""
        return self.draft.propose(req.id, req.prompt + req.tokens, k)


def draft_speculator(path: str, target: nn.Module, tokenizer, tokens: int, sequences: int,
                     max_len: int | None, dtype: str) -> DraftSpeculator:
    """The `DraftSpeculator` of the checkpoint at `path` (any that `tpkit.load` takes),
    loaded here at tp=1 in `dtype` for decoding, refused unless it shares the `target`'s
    vocabulary (`check_vocabulary`)."""
    source = open_source(path)
    model = load_model(source, ParallelMesh.single(), dtype=getattr(torch, dtype), decode=True)
    check_vocabulary(target, model, tokenizer, load_tokenizer(source_tokenizer(source)))
    return DraftSpeculator(Draft(model, sequences, max_len or target.config.max_seq_len),
                           tokens)
