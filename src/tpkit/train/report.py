"""What a run reports at the end: its `RunSummary`, the text report, the theory tables.

    trained <preset> at tp= x pp= x dp= [x cp=] (<schedule>, m micro-batches of b
        sequences per replica) for N steps
    loss <first> (step 1) -> <mean of the last 10 steps>, held-out validation <loss>
    throughput <tokens/s> (<seconds> in all)
    pipeline bubble: idle/busy measured <mean over stages>, theory (p-1)/m = <value>
    <tables: everything sent in one step; tp/pp traffic vs theory, ok or MISMATCH>
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass

from rich.table import Table

from tpkit.comm.ledger_tables import render
from tpkit.spec.words import plural
from tpkit.train.config import TrainConfig
from tpkit.train.data import EMBEDDED_PROMPT, embedded_text

STILL_GUESSING = 1.5  # loss per token above which a byte-level model writes no sentences


@dataclass(frozen=True)
class RunSummary:
    """One rank's result of `tpkit.train.loop.train` (picklable, returned by spawn)."""

    config: TrainConfig
    rank: int
    stage: int  # pp rank
    tp_rank: int
    hidden: int
    micro_batch: int  # sequences per micro-batch and replica
    losses: list[float]  # one per step run (after a resume: from the resumed step on)
    grad_norms: list[float]
    first_step: int
    tail: int  # how many of the last steps `tail_loss` averages
    tail_loss: float
    val_loss: float | None  # the last validation loss, None without validation
    tokens_per_s: float
    seconds: float  # wall time of the steps
    bubble: float  # measured idle/busy, mean over stages
    bubble_theory: float
    max_inflight: int  # most micro-batches whose activations this stage held at once
    table: str  # everything this rank sent in the last step
    theory: str  # its tp/pp traffic against the theory, as a table
    theory_ok: bool  # every row of that table agrees
    checkpoint: str | None  # the last checkpoint written
    metrics: str  # the metrics.jsonl path
    plot: str | None  # the loss curve (rank 0 with plotting on)
    first_step_s: float = 0.0  # the first step run (with --compile: tracing and compiling)
    later_step_s: float = 0.0  # median of the others (0.0 with one step)

    @property
    def first_loss(self) -> float:
        """The loss of the first step run."""
        return self.losses[0]

    @property
    def last_loss(self) -> float:
        """The loss of the last step."""
        return self.losses[-1]


def report(result: RunSummary, tables: list[str]) -> str:
    """The end-of-run summary: loss X -> Y, tokens/s, bubble, comm vs theory, files."""
    c = result.config
    cp = f" x cp={c.cp}" if c.cp > 1 else ""
    lines = [f"trained {c.model_name} at tp={c.tp} x pp={c.pp} x dp={c.dp}{cp} ({c.schedule}, "
             f"{plural(c.micro_batches, 'micro-batch')} of "
             f"{plural(result.micro_batch, 'sequence')} per replica) for "
             f"{plural(c.steps, 'step')}",
             f"loss {result.first_loss:.4f} (step {result.first_step}) -> "
             f"{result.tail_loss:.4f} (mean of the last {plural(result.tail, 'step')})"
             + (f", held-out validation {result.val_loss:.4f}" if result.val_loss else ""),
             f"throughput {result.tokens_per_s:,.0f} tokens/s ({result.seconds:.1f} s in all)"]
    if c.compile:
        lines.append(f"--compile ({c.compile_backend}): first step {result.first_step_s:.1f} s, "
                     f"later steps {result.later_step_s:.2f} s (median): about "
                     f"{result.first_step_s - result.later_step_s:.1f} s of tracing and compiling")
    if c.pp > 1:
        lines.append(f"pipeline bubble: idle/busy measured {result.bubble:.3f} "
                     f"(mean over stages), theory "
                     f"{'(p-1)/(v m)' if c.virtual_stages > 1 else '(p-1)/m'} "
                     f"= {result.bubble_theory:.3f}")
    b, sq, h = result.micro_batch, c.seq, result.hidden
    if c.tp > 1 and not c.sp:
        lines.append(f"theory per micro-batch (Megatron): each layer 2 all-reduces of b*s*h = "
                     f"{b}*{sq}*{h} = {b * sq * h:,} forward and 2 backward; the embedding 1 "
                     f"forward; the head's input 1 backward; cross-entropy 3 of b*s = "
                     f"{b * sq:,} forward" + ("; between stages one activation forward and "
                                              "its gradient back" if c.pp > 1 else ""))
    lines += tables
    lines.append(f"metrics {result.metrics}")
    if result.plot:
        lines.append(f"loss curve {result.plot}")
    if result.checkpoint:
        lines.append(f"checkpoint {result.checkpoint}")
        lines += sample_hint(result)
    return "\n".join(lines)


def sample_hint(result: RunSummary) -> list[str]:
    """The `tpkit generate` line that samples the run's last checkpoint; on the embedded
    corpus, a prompt from it and, while the loss is high, what such a model writes."""
    c = result.config
    tp = f" --tp {c.tp}" if c.tp > 1 else ""  # the run's own tp: one the model admits
    prompt = EMBEDDED_PROMPT if c.data is None else "<a few words of your data>"
    lines = [f"sample it:  tpkit generate --checkpoint {shlex.quote(result.checkpoint)}"
             f"{tp} --prompt {shlex.quote(prompt)} --temperature 0.8 --top-k 40"]
    if c.data is None and result.tail_loss > STILL_GUESSING:
        lines.append(f"  (a prompt from its corpus, Python's help text, "
                     f"{len(embedded_text()) // 1000} KB: after {plural(c.steps, 'step')}, at "
                     f"a loss of {result.tail_loss:.2f}, a model this small writes much the same "
                     f"word-like pieces whatever the prompt and repeats itself (greedy: "
                     f"\"the the the\"): the run works, it has not learnt the language)")
    return lines


def theory_rows(ledger, expects: list) -> list[dict]:
    """One row per (group, op, phase, elements) of tp/pp traffic: recorded vs theory count."""
    want: Counter = Counter()
    for e in expects:
        group = "pp" if e.op in ("send", "recv") else "tp"
        want[(group, e.op, e.phase, e.numel)] += e.count
    got = Counter((r.group, r.op, r.phase, r.numel) for r in ledger.records
                  if r.group in ("tp", "pp") and r.phase in ("forward", "backward"))
    return [dict(group=k[0], op=k[1], phase=k[2], numel=k[3], recorded=got[k], theory=want[k])
            for k in sorted(set(want) | set(got))]


def sharded_rows(ledger, expects: list, scope: str, group: str = "dp") -> list[dict]:
    """`theory_rows` for the dp traffic of ZeRO-2 / FSDP (records of `scope` on dp), or
    the ring attention's on the cp group."""
    want: Counter = Counter()
    for e in expects:
        want[(group, e.op, e.phase, e.numel)] += e.count
    got = Counter((r.group, r.op, r.phase, r.numel) for r in ledger.records
                  if r.group == group and r.scope == scope)
    return [dict(group=k[0], op=k[1], phase=k[2], numel=k[3], recorded=got[k], theory=want[k])
            for k in sorted(set(want) | set(got))]


def theory_table(rows: list[dict], title: str) -> str:
    """`theory_rows` as a text table, with a verdict column."""
    t = Table(title=title)
    for col in ("group", "op", "phase", "elements each", "recorded", "theory", ""):
        t.add_column(col, justify="right" if col in ("elements each", "recorded", "theory")
                     else "left")
    for r in rows:
        t.add_row(r["group"], r["op"], r["phase"], f"{r['numel']:,}", str(r["recorded"]),
                  str(r["theory"]), "ok" if r["recorded"] == r["theory"] else "MISMATCH")
    return render(t)
