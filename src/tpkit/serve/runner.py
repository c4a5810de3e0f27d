"""The executor: every tp rank runs the same forwards each step. Rank 0 decides them
(`tpkit.serve.scheduler`), sends the plan, and the others follow (`follow`), so only
rank 0 needs the requests, the tokenizer and the sampler.

One step of the group, as rank 0 sends it to each other rank of the tp group (through
`tpkit.comm.send`, so the ledger counts it; posted into shared memory, rank 0 does not
wait for the followers to take it: the forward's first collective meets them):

    header int64 [4 + INLINE] = [op, payload length, blocks, greedy, the payload's first
    INLINE integers] (a decode step's whole plan: one message a step), then the rest of
    the payload, if longer, in a second message
        op STEP : the payload int64 [length], the step's forwards:
                  [forwards, then per forward: pieces, then per piece:
                   start, tokens n, blocks m, logits kind + 4 x its adapter (`Piece`),
                   ids [n], block table [m]],
                  then the grammars' trailer (`serve.masks`: [..., its length])
                  -> every rank grows its cache to `blocks`, runs each forward
        op EMBED: the payload int64 [length], an encoder's batch of inputs:
                  [rows b, their lengths n_1..n_b, then each row's ids]
                  -> every rank runs one forward of the b rows, right-padded to the
                  longest, with their attention mask (`Runner.embed_rows`)
        op IDLE : nothing (a heartbeat, so an idle worker's wait never times out; over
                  shared memory a follower waits for a header as long as rank 0 lives,
                  however long it takes to plan the next step)
        op STOP : the followers return

Every rank then holds the same full logits (the all-gather of the forward; greedy:
the same greedy tokens and log-probabilities, `paged_kv.forward(greedy=True)`); rank 0
samples from them and its next plan carries the chosen tokens, so the followers never
sample: no generator to keep in step, one source of truth. A greedy request's grammar
masks every rank's shard, each rank holding the same matcher state (`serve.masks`).
Rank 0's plan carries the block tables; each rank holds its own heads' keys in those
blocks.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from tpkit.comm import recv, send
from tpkit.comm.failure import CollectiveFailed
from tpkit.decode.paged_kv import LAST, PagedCache, Piece, forward, ready
from tpkit.serve.masks import Mirrors, expect

STEP, EMBED, IDLE, STOP = 1, 2, 3, 4
BLOCK_SIZE = 16  # tokens per KV block
INLINE = 124  # payload integers sent with the header (a 1 KB message)


class Runner:
    """The model and its paged KV cache on one rank; `lead_*` on rank 0, `follow` elsewhere.

    It needs only the model: rank 0 plans with the engine's limits (`serve.config`), and
    every rank grows its cache to what each plan says. Built once on rank 0 (the
    engine's, `engine.Intake`) and once on each follower (`serve.workers.follow`)."""

    def __init__(self, model: nn.Module, mirrors: Mirrors | None = None,
                 block_size: int = BLOCK_SIZE, adapters=None) -> None:
        self.model, self.group = model.eval(), model.group
        self.adapters = adapters  # served LoRA adapters (`serve.adapters.Adapters`), or None
        self.mirrors = mirrors or Mirrors()  # a follower's grammars (`serve.masks`)
        self.cache = PagedCache(model, block_size)
        self.device = self.cache.device
        self.steps = self.expected = 0  # steps run; of them, readied before their plan came
        self._head = torch.zeros(4 + INLINE, dtype=torch.long, device=self.device)
        self._ints = self._head.numpy() if self._head.device.type == "cpu" else None

    def _header(self, op: int, payload: list[int] = (), blocks: int = 0, greedy: bool = False
                ) -> tuple[int, int, bool, list[int]]:
        """Rank 0: send every follower the header with `payload` (its first INLINE integers
        inline, the rest after), without waiting for them; followers (op 0): receive them.
        (op, blocks, greedy, payload), on every rank."""
        h = self._head
        if op:
            head = [op, len(payload), blocks, int(greedy), *payload[:INLINE]]
            h.zero_()
            if self._ints is not None:  # the CPU tensor's numpy view: no tensor made
                self._ints[:len(head)] = head
            else:
                h[:len(head)] = torch.tensor(head)
            post(h, self.group)
            if len(payload) > INLINE:
                post(torch.tensor(payload[INLINE:], dtype=torch.long, device=self.device),
                     self.group)
            return op, blocks, greedy, list(payload)
        ch = self.group.shm  # rank 0 may plan for long (it is in no collective then): the
        with ch.patient() if ch is not None else nullcontext():  # wait while it lives
            head = recv(h, self.group, 0, scope="serve.plan").tolist()
        op, length, blocks, greedy = head[:4]
        flat = head[4:4 + min(length, INLINE)]
        if length > INLINE:
            rest = torch.empty(length - INLINE, dtype=torch.long, device=self.device)
            flat += recv(rest, self.group, 0, scope="serve.plan").tolist()
        return op, blocks, bool(greedy), flat

    def lead_step(self, forwards: list[list[Piece]], blocks: int, greedy: bool = False,
                  masks: tuple[list[int], list] | None = None
                  ) -> list[tuple[torch.Tensor | None, list[torch.Tensor]]]:
        """Rank 0: run `forwards` on every rank (the cache grown to `blocks` first);
        each forward's (logits of its pieces' last rows, EVERY pieces' other rows).
        `masks`: the grammars' trailer and rank 0's bitmasks (`serve.masks.Lead.plan`)."""
        trailer, allowed = masks or ([0], None)
        try:
            if self.group.size > 1:
                self._header(STEP, encode(forwards) + trailer, blocks, greedy)
            return self._run(forwards, blocks, greedy, allowed)
        except CollectiveFailed as e:  # a worker died or is stuck: which step it was
            e.after_step(self.steps)
            raise

    def _run(self, forwards, blocks: int, greedy: bool, allowed=None):
        self.cache.grow(blocks)
        out = []
        for i, pieces in enumerate(forwards):
            with self.adapters.select(pieces) if self.adapters else nullcontext():
                out.append(forward(self.model, self.cache, pieces, greedy,
                                   allowed and allowed[i]))
        self.steps += 1  # completed
        return out

    def lead_embed(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: one forward of an encoder over `rows` (token ids) on every rank; the
        final hidden states [b, s, h] and the attention mask [b, s] (1: a real token)."""
        payload = [len(rows), *map(len, rows), *(t for r in rows for t in r)]
        if self.group.size > 1:
            self._header(EMBED, payload)
        return self.embed_rows(rows)

    @torch.no_grad()
    def embed_rows(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of `lead_embed` (every rank): rows right-padded with id 0, masked."""
        s = max(map(len, rows))
        ids = torch.zeros(len(rows), s, dtype=torch.long)
        mask = torch.zeros(len(rows), s, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.model.hidden_states(ids, attention_mask=mask), mask
        self.steps += 1
        return out

    def lead_idle(self) -> None:
        """Rank 0: a heartbeat (followers wait for the next step without timing out)."""
        self._header(IDLE)

    def lead_stop(self) -> None:
        """Rank 0: the followers return from `follow`."""
        self._header(STOP)

    @staticmethod
    def stop_followers(model: nn.Module) -> None:
        """Rank 0, with or without a Runner: STOP to the followers."""
        h = torch.zeros(4 + INLINE, dtype=torch.long, device=next(model.parameters()).device)
        h[0] = STOP
        post(h, model.group)

    @torch.no_grad()
    def follow(self) -> int:
        """Ranks > 0: run what rank 0 sends until STOP; returns the steps run.

        After a greedy step of decode rows alone, a follower readies the step it expects
        next (`_expect`) while rank 0 plans it: when the plan is that one, only the native
        call is left to make (otherwise the plan runs as sent)."""
        try:
            return self._follow()
        except CollectiveFailed as e:  # rank 0 died or is stuck: after which step
            e.after_step(self.steps)
            raise

    def _follow(self) -> int:
        expected = None  # (plan, blocks, the readied step)
        while True:
            op, blocks, greedy, flat = self._header(0)
            if op == STOP:
                return self.steps
            if op == STEP:
                hit = expected is not None and expected[:2] == (flat, blocks) and greedy
                forwards = [expected[3]] if hit else decode(flat)
                allowed = self.mirrors.follow(flat, [sum(1 for p in f if p.logits)
                                                     for f in forwards], greedy)
                if hit:
                    out = [expected[2](allowed[0])]
                    self.steps, self.expected = self.steps + 1, self.expected + 1
                else:
                    expected = None  # (its buffers are the plan's to use now)
                    out = self._run(forwards, blocks, greedy, allowed)
                expected = self._expect(flat, out, blocks) if greedy else None
            else:
                expected = None
            if op == EMBED:
                b, at, rows = flat[0], 1 + flat[0], []
                for n in flat[1:1 + b]:
                    rows.append(flat[at:at + n])
                    at += n
                self.embed_rows(rows)
            self.model.mesh.ledger.clear()  # rank 0 counts them (metrics); memory stays bounded

    def _expect(self, flat: list[int], out, blocks: int) -> tuple | None:
        """The step rank 0 plans after the greedy step `flat` that gave `out` if nothing
        changes (every row one position on, its greedy token in, its blocks the same),
        readied (`paged_kv.ready`): (its plan, blocks, the function that runs it, its
        pieces), or None where that is not a step of decode rows alone that fit their
        blocks."""
        forwards = decode(flat)
        if len(forwards) != 1 or out[0][0] is None:
            return None
        pieces, picked = forwards[0], out[0][0]
        if picked.shape != (len(pieces), 2):
            return None
        nxt = []
        for p, token in zip(pieces, picked[:, 0].tolist()):
            if len(p.tokens) != 1 or p.logits != LAST or p.adapter or \
                    p.start + 2 > len(p.blocks) * self.cache.block_size:
                return None
            nxt.append(Piece([int(token)], p.start + 1, p.blocks, LAST))
        return (encode([nxt]) + expect(flat, picked[:, 0].long().tolist()), blocks,
                ready(self.model, self.cache, nxt, True), nxt)


def post(x: torch.Tensor, group) -> None:
    """Rank 0: `x` to every other rank of `group` (posted: shared memory copies it at
    once, rank 0 goes on)."""
    for dst in range(1, group.size):
        send(x, group, dst, scope="serve.plan")


def encode(forwards: list[list[Piece]]) -> list[int]:
    """The plan's forwards as the flat integers a message carries (`decode`)."""
    out = [len(forwards)]
    for pieces in forwards:
        out.append(len(pieces))
        for p in pieces:
            out += [p.start, len(p.tokens), len(p.blocks), p.logits + 4 * p.adapter,
                    *p.tokens, *p.blocks]
    return out


def decode(flat: list[int]) -> list[list[Piece]]:
    """`encode`'s integers back to the forwards' pieces."""
    at, forwards = 1, []
    for _ in range(flat[0]):
        pieces, count = [], flat[at]
        at += 1
        for _ in range(count):
            start, n, m, kind = flat[at:at + 4]
            at += 4
            pieces.append(Piece(flat[at:at + n], start, flat[at + n:at + n + m], kind % 4,
                                kind // 4))
            at += n + m
        forwards.append(pieces)
    return forwards
