"""The scheduler: which tokens of which requests the next step computes (vLLM v1's shape:
`schedule()` returns a plan, `SchedulerOutput`, that the executor runs and the output
processor reads; nothing here touches a tensor). Its requests are the engine's
`serve.sequence.Seq`s (their state is written here and by the output processor, on the
engine's thread), never their callers' handles.

A request's tokens are its prompt then what it generated; `computed` of them have their
keys in its blocks. Each step, in order:
    1. the running requests: one token each that is decoding (its last, for the next),
       the next piece of each whose prompt is not all computed yet;
    2. waiting requests, in turns (`_turns`: the requests of one POST, its n choices of
       each prompt, take turns with other POSTs', so that a short request arriving behind
       one POST of n x prompts is admitted at the next free place; first come first
       served among equals; a preempted request first), while a running place is free, the
       tokens in flight (prompt + max_tokens of the running) stay within
       `max_tokens_in_flight`, and KV blocks can be had: the prefix cache gives the
       full blocks of its prompt that some request computed before (`blocks`), the
       rest of the prompt is computed in pieces. A waiting request whose next prefix
       block a running request (or one admitted this step) is computing waits for it
       in the queue (those behind it that share nothing go ahead), and is admitted
       with it from the cache: requests arriving together with one system prompt
       compute it once. (vLLM v1 computes such a block once per request of the batch;
       SGLang defers the requests whose prefix matches one being scheduled, as here;
       sharing the uncomputed block in the same forward would rest on the attention
       writing every piece's keys before any piece reads them, and the follower could
       not run ahead of the first anyway: a piece needs every key before it.) It
       waits only while that request progresses: after STALL steps without, it
       computes the block itself (never a wait on a preempted or stalled request).
Prompt tokens computed per step are at most `prefill_per_step` (0: no limit; one piece
always runs), so decodes and pieces of prompts share a step (chunked prefill) and a long
prompt never stalls the running requests for more than one piece. While requests
decode, `schedule(prompt_budget)` bounds a step's prompt tokens further, to the number
it is given (the engine's `serve.pacing`, which keeps the step's time near a decode-only
step's), never below `FLOOR` (a long prompt always progresses); with no request
decoding, `prefill_per_step` alone applies (a lone prompt's TTFT does not suffer).

Two modes (`invariant`):
- default: a piece is what the budget leaves; every piece and decode of a step is one
  forward; a request's prompt blocks are taken at admission, in one run (adjacent
  where the pool allows: its pieces then read their keys in place, no gather), the
  blocks of what it generates as tokens arrive. When none is left for a running
  request, the request admitted last is preempted: its blocks are released and it
  waits at the front of the queue to be recomputed (its prompt and what it generated,
  as a prefill: recompute, not swap; its full prompt blocks are likely still cached).
- batch invariant (`--batch-invariant --decode-chunk C`): the shapes of every forward
  depend on the request alone: a prompt is cut at multiples of `piece` tokens (a
  prefix cache hit is cut down to one) and each piece is a forward of its own; the
  decodes run in forwards of exactly C rows (padding rows in block 0). A request's
  blocks for prompt + max_tokens are taken at admission, so it is never preempted.
  `prompt_budget` is not used (the pieces are fixed by design).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from tpkit.decode.paged_kv import EVERY, LAST, NONE, Piece
from tpkit.kernels.decode_ops import ROWS
from tpkit.serve.blocks import BlockPool, block_keys, root
from tpkit.serve.sequence import Seq

FLOOR = 4  # prompt tokens a step computes at least while requests decode
STALL = 2  # steps a request waits on another's computing its prefix without progress

@dataclass
class Forward:
    """One forward of the plan: its pieces, and the request of each (None: padding)."""

    pieces: list[Piece] = field(default_factory=list)
    reqs: list[Seq | None] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """A step's plan: the forwards to run and the pool size the tensors must hold."""

    forwards: list[Forward]
    blocks: int
    admitted: list[Seq] = field(default_factory=list)
    preempted: list[Seq] = field(default_factory=list)
    prompt_tokens: int = 0  # computed in this step (prefix-cache hits excluded)
    decodes: int = 0  # requests decoding one token in this step
    prefill: list[tuple[int, int]] = field(default_factory=list)  # (start, tokens) of pieces
    drafts: dict[int, list[int]] = field(default_factory=dict)  # request id -> proposed

    @property
    def empty(self) -> bool:
        """Nothing to compute."""
        return not self.forwards


class Scheduler:
    """Admission, chunked prefill, preemption, over a `BlockPool`."""

    def __init__(self, pool: BlockPool, *, max_batch: int, max_tokens_in_flight: int,
                 prefill_per_step: int, chunk: int | None, piece: int,
                 speculator=None) -> None:
        self.pool, self.max_batch, self.budget = pool, max_batch, max_tokens_in_flight
        self.prefill_per_step, self.chunk, self.piece = prefill_per_step, chunk, piece
        self.speculator = speculator  # `serve.speculate.Speculator`, or None
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []

    @property
    def invariant(self) -> bool:
        """The batch-invariant mode."""
        return self.chunk is not None

    def schedule(self, prompt_budget: int | None = None) -> SchedulerOutput:
        """The next step's plan (requests' `blocks` and `slot` updated). While a request
        decodes, at most max(`prompt_budget`, FLOOR) prompt tokens, none if it is 0 (a
        decode-only step; default mode; None: `prefill_per_step` alone)."""
        out = SchedulerOutput([], 0)
        left, opens = self.prefill_per_step or float("inf"), True  # opens: one piece runs
        if prompt_budget is not None and not self.invariant and \
                any(_decoding(r) for r in self.running):
            opens = prompt_budget > 0
            left = min(left, max(prompt_budget, FLOOR)) if opens else 0
        decodes, pieces = [], []
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted for an earlier one
            n = self._next(req, left, opens and not pieces)
            if n == 0:
                continue
            if not self._room(req, req.computed + n, out):
                continue  # it was itself preempted
            if _decoding(req):
                decodes.append(req)
            else:
                pieces.append((req, n))
                left -= n
        computing = self._computing() if self.waiting and self.pool.caching else {}
        for req in self._turns() if len(self.running) < self.max_batch else []:
            if len(self.running) >= self.max_batch:
                break
            if self._defer(req, computing):
                continue  # its prefix is being computed: it waits for the cache
            held = sum(len(r.prompt) + r.params.max_tokens for r in self.running)
            if held + len(req.prompt) + req.params.max_tokens > self.budget:
                break  # in its turn: it waits, and those behind it
            req.computed, req.prefill_end = 0, _tokens(req)
            if self._next(req, left, opens and not pieces) == 0:
                break  # this step's prompt budget is spent
            if not self._admit(req):
                break
            self.waiting.remove(req)
            self.running.append(req)
            out.admitted.append(req)
            req.preempted = False
            if self.pool.caching:  # its prompt's blocks: those behind it may wait for them
                self._computing(req, computing)
            n = self._next(req, left, opens and not pieces)
            if n == 0 or not self._room(req, req.computed + n, out):
                continue
            pieces.append((req, n))
            left -= n
        for i, req in enumerate(self.running):
            req.slot = i
        if self.speculator is not None and decodes and (self.invariant or not pieces):
            out.drafts = self.speculator.propose(decodes, self._spare(len(decodes)),
                                                 self._capacity)
        self._plan(out, decodes, pieces)
        out.blocks = self.pool.size
        return out

    def _turns(self) -> list[Seq]:
        """The waiting requests in the order they are admitted: the preempted first, then
        a POST's k-th request still waiting after those of the POSTs with fewer requests
        running or waiting before it (its group's load), first come first served among
        equal loads."""
        load = Counter(r.group for r in self.running)
        order = []
        for i, req in enumerate(self.waiting):
            order.append((not req.preempted, load[req.group], i, req))
            load[req.group] += 1
        return [req for *_, req in sorted(order, key=lambda o: o[:3])]

    def prompt_start(self) -> int | None:
        """The context position the next piece of a prompt starts at (a running
        request's, else the first waiting one's, prefix-cache hits not counted); None
        if no prompt waits to be computed."""
        for req in self.running:
            if not _decoding(req) and req.computed < _tokens(req):
                return req.computed
        return 0 if self.waiting else None

    def _keys(self, req: Seq) -> list[int]:
        """The chain keys of the full blocks of `req`'s tokens (kept while they last)."""
        n = _tokens(req)
        if req.keys[0] != n:
            req.keys = (n, block_keys(req.prompt + req.tokens, self.pool.block_size,
                                      root(req.params.adapter)))
        return req.keys[1]

    def _computing(self, req: Seq | None = None,
                   into: dict[int, Seq] | None = None) -> dict[int, Seq]:
        """Chain key -> the running request (or only `req`) computing that full block of
        its prompt, not yet in the prefix cache."""
        into = {} if into is None else into
        for r in self.running if req is None else [req]:
            full = r.prefill_end // self.pool.block_size
            if r.registered < full:  # (a decoding one's keys are not hashed again)
                for key in self._keys(r)[r.registered:full]:
                    into.setdefault(key, r)
        return into

    def _usable(self, req: Seq) -> int:
        """How many full blocks of `req`'s tokens the prefix cache may give it."""
        if req.params.echo and req.params.logprobs is not None:
            return 0  # every prompt position's logits are needed: nothing from the cache
        usable = (_tokens(req) - 1) // self.pool.block_size  # one token at least computed
        if self.invariant:
            usable = usable * self.pool.block_size // self.piece * self.piece // \
                self.pool.block_size
        return usable

    def _defer(self, req: Seq, computing: dict[int, Seq]) -> bool:
        """Does waiting `req` wait for a running request computing the next block of its
        prefix (it is admitted once that block is in the cache)? Only while that request
        progresses: after STALL steps without, `req` computes the block itself."""
        keys = self._keys(req)[:self._usable(req)] if computing else []
        hit = self.pool.cached(keys)
        owner = computing.get(keys[hit]) if hit < len(keys) else None
        if owner is None:
            req.waits = None
            return False
        seen = req.waits
        if seen is None or seen[0] is not owner or owner.computed > seen[1]:
            req.waits = (owner, owner.computed, 0)
            return True
        req.waits = (owner, owner.computed, seen[2] + 1)
        return seen[2] + 1 <= STALL

    def _next(self, req: Seq, left: float, first: bool) -> int:
        """Tokens of `req` to compute this step (0: none, the budget is spent)."""
        todo = _tokens(req) - req.computed
        if todo <= 1 and req.computed >= req.prefill_end:
            return todo  # a decode (never counted against the prompt budget)
        n = todo
        if self.invariant:
            n = min(n, self.piece - req.computed % self.piece)
            return n if first or n <= left else 0
        return int(min(n, left)) if left >= 1 else (n if first else 0)

    def _admit(self, req: Seq) -> bool:
        """Find its cached prefix and take its blocks (False: it must wait)."""
        bs = self.pool.block_size
        hits = self.pool.lookup(self._keys(req)[:self._usable(req)])
        req.blocks, req.computed, req.waits = hits, len(hits) * bs, None
        req.cached = req.registered = len(hits)
        req.prefill_end = _tokens(req)
        if self.invariant:
            need = -(-(len(req.prompt) + req.params.max_tokens) // bs) - len(hits)
        else:
            need = -(-req.prefill_end // bs) - len(hits)  # its prompt's, in one run
        fresh = self.pool.allocate(need)
        if fresh is None:
            self.pool.release(hits)
            req.blocks, req.computed, req.cached = [], 0, 0
            return False
        req.blocks = hits + fresh
        return True

    def _room(self, req: Seq, upto: int, out: SchedulerOutput) -> bool:
        """Blocks for `req`'s first `upto` tokens, preempting the last admitted requests
        while there are none; False if `req` itself was preempted."""
        need = -(-upto // self.pool.block_size) - len(req.blocks)
        while need > 0:
            fresh = self.pool.allocate(need)
            if fresh is not None:
                req.blocks += fresh
                return True
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _spare(self, decodes: int) -> int:
        """Rows a step of `decodes` decode rows has for proposed tokens: the padding of
        its C-row forwards (batch invariant), else up to `decode_ops.ROWS` in all."""
        if self.invariant:
            return -(-decodes // self.chunk) * self.chunk - decodes
        return max(0, ROWS - decodes)

    def _capacity(self, req: Seq, upto: int) -> int:
        """Tokens `req`'s blocks hold once grown towards `upto` from free blocks alone
        (speculation never preempts nor evicts the prefix cache)."""
        bs, pool = self.pool.block_size, self.pool
        need = min(-(-upto // bs) - len(req.blocks),
                   len(pool.free) + pool.max_blocks - pool.size)
        if need > 0:
            req.blocks += pool.allocate(need)
        return len(req.blocks) * bs

    def rolled_back(self, req: Seq) -> None:
        """After a verify step: `req`'s keys are its tokens' but the last (the rows past
        the first rejected token are not), and the blocks past them free (default mode;
        batch invariant: its blocks were taken to the end at admission)."""
        req.computed = _tokens(req) - 1
        keep = -(-_tokens(req) // self.pool.block_size)
        if not self.invariant and len(req.blocks) > keep:
            self.pool.release(req.blocks[keep:])
            del req.blocks[keep:]

    def preempt(self, req: Seq) -> None:
        """Release `req`'s blocks; it waits first in line to be computed again."""
        self.running.remove(req)
        self.pool.release(req.blocks)
        req.blocks, req.computed, req.slot, req.preempted = [], 0, None, True
        self.waiting.appendleft(req)

    def finish(self, req: Seq) -> None:
        """`req` is done (or cancelled): its place and blocks are free."""
        if req in self.running:
            self.running.remove(req)
            self.pool.release(req.blocks)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.blocks, req.slot = [], None

    def computed(self, out: SchedulerOutput) -> None:
        """After the step ran: each piece's tokens are in its blocks; full blocks of a
        prompt computed as prefill enter the prefix cache."""
        bs = self.pool.block_size
        for fwd in out.forwards:
            for piece, req in zip(fwd.pieces, fwd.reqs):
                if req is None:
                    continue
                req.computed = piece.start + len(piece.tokens)
                full = min(req.computed, req.prefill_end) // bs
                if full > req.registered:
                    keys = self._keys(req)
                    for b in range(req.registered, full):
                        self.pool.register(req.blocks[b], keys[b])
                    req.registered = full

    def _plan(self, out: SchedulerOutput, decodes: list[Seq],
              pieces: list[tuple[Seq, int]]) -> None:
        def piece(req: Seq, n: int) -> Piece:
            toks = (req.prompt + req.tokens)[req.computed:req.computed + n]
            end = req.computed + n == _tokens(req)
            every = req.params.echo and req.params.logprobs is not None and \
                req.computed < len(req.prompt)
            kind = EVERY if every else LAST if end else NONE
            return Piece(toks, req.computed, list(req.blocks), kind, req.params.adapter)

        out.prompt_tokens = sum(n for _, n in pieces)
        out.decodes, out.prefill = len(decodes), [(r.computed, n) for r, n in pieces]
        rows = []  # each decode's row, then one per proposed token (`serve.speculate`)
        for r in decodes:
            rows.append((piece(r, 1), r))
            rows += [(Piece([t], r.computed + 1 + i, list(r.blocks), LAST,
                            r.params.adapter), r)
                     for i, t in enumerate(out.drafts.get(r.id, ()))]
        if not self.invariant:
            if rows or pieces:
                out.forwards.append(Forward([piece(r, n) for r, n in pieces] +
                                            [p for p, _ in rows],
                                            [r for r, _ in pieces] + [r for _, r in rows]))
            return
        for req, n in pieces:
            out.forwards.append(Forward([piece(req, n)], [req]))
        for i in range(0, len(rows), self.chunk):
            group = rows[i:i + self.chunk]
            pad = self.chunk - len(group)
            out.forwards.append(Forward([p for p, _ in group] +
                                        [Piece([0], 0, [0], LAST)] * pad,
                                        [*(r for _, r in group), *[None] * pad]))


def _tokens(req: Seq) -> int:
    return len(req.prompt) + len(req.tokens)


def _decoding(req: Seq) -> bool:
    """Its prompt is computed: the next step computes its one new token."""
    return _tokens(req) - req.computed == 1 and req.computed >= req.prefill_end
