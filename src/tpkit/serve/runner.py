"""Every tp rank runs the same forward each step: rank 0 decides it, broadcasts it, and
the others follow (`follow`), so only rank 0 needs the requests, the tokenizer and the
sampler.

One step of the group, as rank 0 broadcasts it over the tp group (through
`tpkit.comm.broadcast`, so the ledger counts it):

    header int64 [3 + 2*slots] = [op, slot, n, tokens[slots], lengths[slots]]
        op PREFILL: then ids int64 [n] (a second broadcast) -> prefill(slot, ids)
        op SCORE  : the same, with the logits of every position (a request's `echo`)
        op DECODE : decode(tokens, lengths)      (a token per busy slot; -1: free)
        op GREEDY : the same, every request greedy: each rank's best instead of its logits
        op IDLE   : nothing (a heartbeat, so an idle worker's wait never times out)
        op STOP   : the followers return

Every rank then holds the same full logits (the all-gather of the forward; GREEDY:
the same greedy tokens and log-probabilities, `kv_pool.decode(greedy=True)`); rank 0
samples from them and puts the chosen tokens in the next DECODE header, so the
followers never sample: no generator to keep in step, one source of truth.
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.comm import broadcast
from tpkit.model.kv_pool import KVPool, decode, prefill

PREFILL, DECODE, IDLE, STOP, SCORE, GREEDY = 1, 2, 3, 4, 5, 6


class Runner:
    """The model and its KV pool on one rank; `lead_*` on rank 0, `follow` elsewhere."""

    def __init__(self, model: nn.Module, slots: int, max_len: int, chunk: int | None = None
                 ) -> None:
        self.model, self.group = model.eval(), model.group
        self.pool = KVPool(model, slots, max_len, chunk=chunk)  # None: the busy slots
        self.device = self.pool.k[0].device
        self.steps = 0

    @property
    def slots(self) -> int:
        """Number of sequences the pool holds."""
        return self.pool.slots

    def _header(self, op: int, slot: int = 0, n: int = 0, tokens=None, lengths=None
                ) -> torch.Tensor:
        h = torch.zeros(3 + 2 * self.slots, dtype=torch.long, device=self.device)
        h[0], h[1], h[2] = op, slot, n
        if tokens is not None:
            h[3:3 + self.slots] = tokens
            h[3 + self.slots:] = lengths
        return broadcast(h, self.group, 0, scope="serve.plan")

    def lead_prefill(self, slot: int, ids: list[int], every: bool = False) -> torch.Tensor:
        """Rank 0: prefill `ids` into `slot` on every rank; the logits [V] (`every`: [s, V],
        after each token)."""
        self._header(SCORE if every else PREFILL, slot, len(ids))
        t = broadcast(torch.tensor(ids, dtype=torch.long, device=self.device), self.group, 0,
                      scope="serve.plan")
        self.steps += 1
        return prefill(self.model, self.pool, slot, t, every)

    def lead_decode(self, tokens: torch.Tensor, lengths: torch.Tensor, greedy: bool = False
                    ) -> torch.Tensor:
        """Rank 0: one token for every slot on every rank; the logits [slots, V] (`greedy`:
        [slots, 2], each slot's greedy token and log-probability)."""
        self._header(GREEDY if greedy else DECODE, tokens=tokens, lengths=lengths)
        self.steps += 1
        return decode(self.model, self.pool, tokens, lengths, greedy)

    def lead_idle(self) -> None:
        """Rank 0: a heartbeat (followers wait for the next step without timing out)."""
        self._header(IDLE)

    def lead_stop(self) -> None:
        """Rank 0: the followers return from `follow`."""
        self._header(STOP)

    @staticmethod
    def stop_followers(model: nn.Module, slots: int) -> None:
        """Rank 0, with or without a Runner: STOP to followers of a `slots`-slot pool."""
        h = torch.zeros(3 + 2 * slots, dtype=torch.long, device=next(model.parameters()).device)
        h[0] = STOP
        broadcast(h, model.group, 0, scope="serve.plan")

    def follow(self) -> int:
        """Ranks > 0: run what rank 0 broadcasts until STOP; returns the steps run."""
        s = self.slots
        while True:
            h = self._header(0)  # filled by rank 0's broadcast
            op, slot, n = (int(v) for v in h[:3])
            if op == STOP:
                return self.steps
            if op in (PREFILL, SCORE):
                ids = broadcast(torch.zeros(n, dtype=torch.long, device=self.device),
                                self.group, 0, scope="serve.plan")
                prefill(self.model, self.pool, slot, ids, every=op == SCORE)
                self.steps += 1
            elif op in (DECODE, GREEDY):
                decode(self.model, self.pool, h[3:3 + s], h[3 + s:], op == GREEDY)
                self.steps += 1
            self.model.mesh.ledger.clear()  # rank 0 counts them (metrics); memory stays bounded
