"""Structured outputs on every tp rank's vocabulary shard: the grammar's mask applied
where each rank holds its logits, so a greedy request with a schema keeps the greedy
path (each shard's best, no full-vocabulary gather: `paged_kv.forward(greedy=True)`).

Every rank holds the same matcher state: rank 0's matchers are the requests' own
(`OutputProcessor`); each follower keeps a mirror of each, built from the grammar the
plan carries the first time and moved on by the tokens the plan carries (the tokens
rank 0 chose, which every rank already computed in a greedy step), so every rank
computes the same bitmask over the whole vocabulary and masks its own shard with it
(`decode_ops.shard_best`'s `allowed`). Sampling stays on rank 0's full logits (its
draw, top-k and top-p need them; `serve.output`), the mask applied there.

The plan's trailer (after the forwards, `serve.runner`), one entry per logits row of a
request with a grammar, then the trailer's length:

    [forward, row, request id, n, n tokens the mirror has not taken yet,
     b, the grammar's b UTF-8 bytes in ceil(b / 8) int64 words (b = 0: the mirror has it)]

A follower keeps the mirrors of the requests in the latest step's trailer only; rank 0
(`Lead`) knows which those are and sends a grammar (and every token) again to a follower
that dropped it. A step that is not greedy carries an empty trailer (no mask is needed
on the followers then).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tpkit.serve.grammar import Grammars, Matcher


class Lead:
    """Rank 0's side: each step's trailer (`followers`: there are some to send it to),
    and the bitmasks of its own shard."""

    def __init__(self, followers: bool = True) -> None:
        self.followers = followers
        self.held: dict[int, int] = {}  # request id -> tokens the followers' mirror took

    def plan(self, forwards, greedy: bool) -> tuple[list[int], list[torch.Tensor | None]]:
        """The trailer of a step of `forwards` (the scheduler's, each with `pieces` and
        `reqs`), and each forward's bitmasks int32 [rows, words] (None: no grammar)."""
        if not greedy:
            self.held = {}
            return [0], [None] * len(forwards)
        trailer, masks, held = [], [], {}
        for f, fwd in enumerate(forwards):
            rows = [req for piece, req in zip(fwd.pieces, fwd.reqs) if piece.logits]
            masks.append(bitmasks([getattr(r, "matcher", None) for r in rows]))
            for j, req in enumerate(rows):
                if self.followers and getattr(req, "matcher", None) is not None:
                    trailer += self._entry(f, j, req, held)
        self.held = held
        return [*trailer, len(trailer) + 1], masks

    def _entry(self, f: int, j: int, req, held: dict[int, int]) -> list[int]:
        if req.id in held:  # a second row of the request in this step: nothing new
            return [f, j, req.id, 0, 0]
        took = self.held.get(req.id)
        new = req.tokens[took or 0:]
        held[req.id] = len(req.tokens)
        return [f, j, req.id, len(new), *new,
                *([0] if took is not None else packed(req.params.grammar))]


class Mirrors:
    """A follower's side: its mirrors of rank 0's matchers, and their bitmasks.
    `grammars`: makes the `Grammars` (the tokenizer: loaded when a grammar first comes)."""

    def __init__(self, grammars: Callable[[], Grammars] | None = None) -> None:
        self._make, self._grammars = grammars, None
        self.matchers: dict[int, Matcher] = {}

    def follow(self, flat: list[int], rows: list[int], greedy: bool
               ) -> list[torch.Tensor | None]:
        """Take the trailer of the plan `flat` (forwards of `rows` logits rows each): the
        mirrors moved on; each forward's bitmasks (as `Lead.plan`'s, the same bits)."""
        entries, kept = parse(flat), {}
        for _, _, rid, tokens, grammar in entries:
            m = self._new(grammar) if grammar is not None else \
                kept.get(rid) or self.matchers[rid]
            for t in tokens:
                m.take(t)
            kept[rid] = m
        self.matchers = kept
        if not greedy:
            return [None] * len(rows)
        at: list[list[Matcher | None]] = [[None] * n for n in rows]
        for f, j, rid, _, _ in entries:
            at[f][j] = kept[rid]
        return [bitmasks(ms) for ms in at]

    def _new(self, grammar: str) -> Matcher:
        if self._grammars is None:
            if self._make is None:
                raise RuntimeError("a grammar came to a follower without a tokenizer")
            self._grammars = self._make()
        return self._grammars.matcher(grammar)


def expect(flat: list[int], picked: list[int]) -> list[int]:
    """The trailer rank 0 sends next after the greedy step `flat` of one forward whose
    rows picked `picked`, if nothing changes (each row one token on: `runner._expect`)."""
    out = []
    for _, j, rid, _, _ in parse(flat):
        out += [0, j, rid, 1, picked[j], 0]
    return [*out, len(out) + 1]


def parse(flat: list[int]) -> list[tuple[int, int, int, list[int], str | None]]:
    """A plan's trailer (its last integers) -> (forward, row, request id, tokens,
    grammar or None) entries."""
    end = len(flat) - 1
    at, out = end - flat[end] + 1, []
    while at < end:
        f, j, rid, n = flat[at:at + 4]
        tokens = flat[at + 4:at + 4 + n]
        at += 4 + n
        size = flat[at]
        words = -(-size // 8)
        grammar = None if size == 0 else np.array(flat[at + 1:at + 1 + words], np.int64
                                                   ).tobytes()[:size].decode()
        at += 1 + words
        out.append((f, j, rid, tokens, grammar))
    return out


def packed(grammar: str) -> list[int]:
    """A grammar as [its UTF-8 length, then its bytes in int64 words] (`parse`)."""
    raw = grammar.encode()
    pad = raw + bytes(-len(raw) % 8)
    return [len(raw), *np.frombuffer(pad, np.int64).tolist()]


def bitmasks(matchers: list[Matcher | None]) -> torch.Tensor | None:
    """Rows' bitmasks int32 [rows, words] over the whole vocabulary (a row without a
    matcher: all ones), or None where no row has one."""
    if not any(m is not None for m in matchers):
        return None
    words = next(m for m in matchers if m is not None).words
    out = np.full((len(matchers), words), -1, np.int32)
    for i, m in enumerate(matchers):
        if m is not None:
            out[i] = m.bits()
    return torch.from_numpy(out)
