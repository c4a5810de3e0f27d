"""The ledger: every collective, with its op, group, size, time, scope and phase.

    with ledger.scope("layers.3.mlp"):
        y = mlp(x)                # the forward all-reduce is recorded here,
    y.sum().backward()            # and the backward one under the same scope.
    print(ledger.table())

Bytes are counted two ways: `nbytes` is the logical tensor (an all-reduce of
b*s*h floats has nbytes = 4*b*s*h, as has the all-gather that rebuilds [b, s, h]);
`wire_bytes` is what each rank puts on the link with a ring algorithm
(`spec.theory.ring_factor`: all-reduce 2(p-1)/p * n, all-gather and reduce-scatter
(p-1)/p * n), so one
all-reduce costs exactly one reduce-scatter plus one all-gather.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tpkit.comm.ledger_tables import render_summary
from tpkit.spec.theory import as_counter, ring_factor


@dataclass(slots=True, unsafe_hash=True)  # not frozen: a frozen one costs 1.5 us more to
class Record:                              # create, on every collective; never mutated
    """One collective as it happened on this rank."""

    op: str  # all_reduce, all_gather, reduce_scatter, broadcast, send, recv
    group: str  # the group's name (tp, pp, dp)
    group_size: int
    numel: int  # elements of the logical (full) tensor
    nbytes: int
    seconds: float
    scope: str  # e.g. "layers.3.mlp"
    phase: str  # forward, backward, or a label such as "grads"
    start: float = 0.0  # time.perf_counter() when it was called (posted, if asynchronous)
    end: float = 0.0  # ... when it returned (its wait returned); end - start >= seconds

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends with a ring algorithm."""
        if self.op in ("send", "recv"):
            return float(self.nbytes)
        return ring_factor(self.op, self.group_size) * self.nbytes


class Ledger:
    """Records collectives; prints summaries; checks them against a theory."""

    def __init__(self, enabled: bool = True) -> None:
        self.records: list[Record] = []
        self.enabled = enabled
        self._scopes: list[str] = [""]  # the dotted scope at each depth (top level: "")

    # -- recording ---------------------------------------------------------------------
    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Attribute the collectives run inside this block (forward) to `name`."""
        outer = self._scopes[-1]
        self._scopes.append(f"{outer}.{name}" if outer and name else outer or name)
        try:
            yield
        finally:
            self._scopes.pop()

    def current_scope(self) -> str:
        """The innermost scope name, dotted with its parents ('' at top level)."""
        return self._scopes[-1]

    @contextmanager
    def timed(self, op: str, group, numel: int, nbytes: int, phase: str, scope: str | None):
        """Time the block and record it as one collective."""
        t0 = time.perf_counter()
        yield
        t1 = time.perf_counter()
        self.add(op, group, numel, nbytes, t1 - t0, phase, scope, span=(t0, t1))

    def add(self, op: str, group, numel: int, nbytes: int, seconds: float, phase: str,
            scope: str | None, span: tuple[float, float] | None = None) -> None:
        """Record one collective that took `seconds` of this rank's time, between the
        `span` (start, end) of `time.perf_counter()` (in flight longer, if asynchronous)."""
        if self.enabled:
            start, end = span or (0.0, 0.0)
            self.records.append(Record(op, group.name, group.size, numel, nbytes, seconds,
                                       self.current_scope() if scope is None else scope, phase,
                                       start, end))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop recording inside the block (e.g. for warm-up iterations)."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    def clear(self) -> None:
        """Forget every record."""
        self.records.clear()

    # -- reading -----------------------------------------------------------------------
    def select(self, scope: str | None = None, phase: str | None = None,
               group: str | None = None) -> list[Record]:
        """Records whose scope starts with `scope` (and matching phase/group if given)."""
        out = []
        for r in self.records:
            if scope is not None and not (r.scope == scope or r.scope.startswith(scope + ".")):
                continue
            if phase is not None and r.phase != phase:
                continue
            if group is not None and r.group != group:
                continue
            out.append(r)
        return out

    def counts(self, **select) -> Counter:
        """Counter of (op, phase, numel) over the selected records."""
        return Counter((r.op, r.phase, r.numel) for r in self.select(**select))

    def summary(self, by_scope: bool = True, **select) -> list[dict]:
        """Aggregated rows: scope, group, op, phase, count, numel each, bytes, wire bytes, s."""
        rows: dict[tuple, dict] = {}
        for r in self.select(**select):
            key = (r.scope if by_scope else "", r.group, r.op, r.phase, r.numel)
            row = rows.setdefault(key, dict(scope=key[0], group=r.group, op=r.op, phase=r.phase,
                                            numel=r.numel, count=0, nbytes=0, wire_bytes=0.0,
                                            seconds=0.0))
            row["count"] += 1
            row["nbytes"] += r.nbytes
            row["wire_bytes"] += r.wire_bytes
            row["seconds"] += r.seconds
        return list(rows.values())

    def total(self, **select) -> dict:
        """Totals over the selected records: count, nbytes, wire_bytes, seconds."""
        recs = self.select(**select)
        return dict(count=len(recs), nbytes=sum(r.nbytes for r in recs),
                    wire_bytes=sum(r.wire_bytes for r in recs),
                    seconds=sum(r.seconds for r in recs))

    def compare(self, theory, **select) -> list[str]:
        """Differences between the records and a theory (list of `theory.Expect`).

        Returns an empty list when every expected collective happened exactly the
        expected number of times, with the expected size, and nothing else did.
        """
        want, got = as_counter(theory), self.counts(**select)
        problems = []
        for key in sorted(set(want) | set(got)):
            if want[key] != got[key]:
                op, phase, numel = key
                problems.append(f"{op} {phase} of {numel} elements: expected {want[key]}, "
                                f"recorded {got[key]}")
        return problems

    def table(self, title: str = "communication ledger", by_scope: bool = True, **select) -> str:
        """The summary as a plain-text table."""
        return render_summary(self.summary(by_scope=by_scope, **select), title)
