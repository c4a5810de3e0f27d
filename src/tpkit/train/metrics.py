"""What a run shows and leaves behind: progress bar, metrics JSONL, loss curve, report.

    out/metrics.jsonl   one JSON object per step (loss, lr, grad_norm, tokens/s, comm, bubble)
    out/loss.png        training (and validation) loss against the step
"""

from __future__ import annotations

import json
from pathlib import Path

from tpkit.comm.ledger import Record
from tpkit.comm.report import human_bytes


def comm_by_group(records: list[Record]) -> dict[str, dict]:
    """group name -> {count, bytes, seconds} over the records of one step."""
    out: dict[str, dict] = {}
    for r in records:
        row = out.setdefault(r.group, dict(count=0, bytes=0, seconds=0.0))
        row["count"] += 1
        row["bytes"] += r.nbytes
        row["seconds"] += r.seconds
    return out


def comm_line(by_group: dict[str, dict]) -> str:
    """'tp 48x 3.1 MiB | pp 8x 256.0 KiB' (one step, this rank)."""
    return " | ".join(f"{g} {v['count']}x {human_bytes(v['bytes'])}"
                      for g, v in sorted(by_group.items())) or "no communication"


class MetricsLog:
    """Appends one JSON line per step to `path` (rank 0 only writes). A resumed run keeps
    the rows of the steps before `resume_step` and drops the later ones it will redo."""

    def __init__(self, path: Path | None, resume_step: int = 0) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            old = path.read_text().splitlines() if resume_step and path.is_file() else []
            kept = [r for r in old if r.strip() and json.loads(r).get("step", 0) <= resume_step]
            path.write_text("".join(r + "\n" for r in kept))

    def write(self, row: dict) -> None:
        """Append a row."""
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


class Progress:
    """A rich progress bar with loss, tokens/s and the step's communication (or nothing)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
            from rich.progress import TimeRemainingColumn as Eta

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), Eta(),
                                TextColumn("{task.fields[info]}"))
            self.task = self.bar.add_task("train", total=total, info="")
            self.bar.start()

    def update(self, row: dict) -> None:
        """Advance one step and show its numbers."""
        if self.bar is not None:
            info = (f"loss {row['loss']:.4f}  {row['tokens_per_s']:,.0f} tok/s  "
                    f"comm {row['comm_line']}")
            self.bar.update(self.task, advance=1, info=info)

    def close(self) -> None:
        """Stop the live display."""
        if self.bar is not None:
            self.bar.stop()


def plot_losses(rows: list[dict], path: Path, title: str) -> Path:
    """Training loss (and validation loss points) against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(result: dict, tables: list[str]) -> str:
    """The end-of-run summary: loss X -> Y, tokens/s, bubble, comm vs theory, files."""
    lines = [f"trained {result.get('model', result['preset'])} at tp={result['tp']} x pp={result['pp']} x "
             f"dp={result['dp']} ({result['schedule']}, {result['micro_batches']} micro-batches) "
             f"for {result['steps']} steps",
             f"loss {result['first_loss']:.4f} (step {result.get('first_step', 1)}) -> {result['tail_loss']:.4f} (mean of the "
             f"last {result['tail']} steps)"
             + (f", held-out validation {result['val_loss']:.4f}" if result.get("val_loss") else ""),
             f"throughput {result['tokens_per_s']:,.0f} tokens/s "
             f"({result['seconds']:.1f} s in all)"]
    if result["pp"] > 1:
        lines.append(f"pipeline bubble: idle/busy measured {result['bubble']:.3f} "
                     f"(mean over stages), theory "
                     f"{'(p-1)/(v m)' if result.get('virtual_stages', 1) > 1 else '(p-1)/m'} "
                     f"= {result['bubble_theory']:.3f}")
    b, sq, h, tp = result["micro_batch"], result["seq"], result["hidden"], result["tp"]
    if tp > 1 and not result["sp"]:
        lines.append(f"theory per micro-batch (Megatron): each layer 2 all-reduces of b*s*h = "
                     f"{b}*{sq}*{h} = {b * sq * h:,} forward and 2 backward; the embedding 1 "
                     f"forward; the head's input 1 backward; cross-entropy 3 of b*s = "
                     f"{b * sq:,} forward" + ("; between stages one activation forward and "
                                              "its gradient back" if result["pp"] > 1 else ""))
    lines += tables
    lines.append(f"metrics {result['metrics']}")
    if result.get("plot"):
        lines.append(f"loss curve {result['plot']}")
    if result.get("checkpoint"):
        lines.append(f"checkpoint {result['checkpoint']}")
        lines.append(f"sample it:  tpkit generate --checkpoint {result['checkpoint']} --tp 2 "
                     f"--prompt 'The return statement' --temperature 0.8 --top-k 40")
    return "\n".join(lines)


def stage_theory(hidden: int, b: int, s: int, tp: int, pp: int, sp: bool, m: int,
                 first: bool, last: bool, num_layers: int, chunks: int = 1) -> list:
    """What one step must send on this rank's tp and pp groups (tpkit.spec.theory).

    Per micro-batch: `theory.stage` (embedding on the first stage, 2+2 per layer,
    head and the three cross-entropy all-reduces on the last); and between stages
    one activation forward and its gradient backward, [b, s, h] ([b, s/tp, h] with SP),
    per chunk of the stage (interleaved), except out of the very last chunk and into
    the very first one.
    """
    from tpkit.spec import theory

    one = theory.stage(b, s, hidden, tp, sp, num_layers, first=first, last=last)
    act = b * (s // tp if sp else s) * hidden
    out, into = chunks - last, chunks - first  # activations leaving / entering the stage
    if pp > 1 and out:
        one += [theory.Expect("send", "forward", act, out),
                theory.Expect("recv", "backward", act, out)]
    if pp > 1 and into:
        one += [theory.Expect("recv", "forward", act, into),
                theory.Expect("send", "backward", act, into)]
    return [theory.Expect(e.op, e.phase, e.numel, e.count * m) for e in one]


def theory_rows(ledger, expects: list) -> list[dict]:
    """One row per (group, op, phase, elements) of tp/pp traffic: recorded vs theory count."""
    from collections import Counter

    want: Counter = Counter()
    for e in expects:
        group = "pp" if e.op in ("send", "recv") else "tp"
        want[(group, e.op, e.phase, e.numel)] += e.count
    got = Counter((r.group, r.op, r.phase, r.numel) for r in ledger.records
                  if r.group in ("tp", "pp") and r.phase in ("forward", "backward"))
    return [dict(group=k[0], op=k[1], phase=k[2], numel=k[3], recorded=got[k], theory=want[k])
            for k in sorted(set(want) | set(got))]


def theory_table(rows: list[dict], title: str) -> str:
    """`theory_rows` as a text table, with a verdict column."""
    from rich.table import Table

    from tpkit.comm.report import render

    t = Table(title=title)
    for col in ("group", "op", "phase", "elements each", "recorded", "theory", ""):
        t.add_column(col, justify="right" if col in ("elements each", "recorded", "theory")
                     else "left")
    for r in rows:
        t.add_row(r["group"], r["op"], r["phase"], f"{r['numel']:,}", str(r["recorded"]),
                  str(r["theory"]), "ok" if r["recorded"] == r["theory"] else "MISMATCH")
    return render(t)
