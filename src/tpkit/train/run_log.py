"""What a run leaves behind while it trains: progress bar, metrics JSONL, loss curve.

    out/metrics.jsonl   one JSON object per step (loss, lr, grad_norm, tokens/s, comm, bubble)
    out/loss.png        training (and validation) loss against the step
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich import progress as rich_progress

from tpkit.checkpoint.disk import writing
from tpkit.comm.ledger import Record
from tpkit.comm.ledger_tables import human_bytes
from tpkit.spec.errors import RunFailed


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
    """Appends one JSON line per step to `path` (rank 0 only writes), and gives the row to
    the run's experiment trackers (`tpkit.train.trackers`), if any. A resumed run keeps
    the rows of the steps before `resume_step` and drops the later ones it will redo."""

    def __init__(self, path: Path | None, resume_step: int = 0, trackers=None) -> None:
        self.path, self.trackers = path, trackers
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            old = path.read_text().splitlines() if resume_step and path.is_file() else []
            kept = [r for r in old if r.strip() and json.loads(r).get("step", 0) <= resume_step]
            path.write_text("".join(r + "\n" for r in kept))

    def write(self, row: dict) -> None:
        """Append a row."""
        if self.path is not None:
            line = json.dumps(row) + "\n"
            with writing(self.path, len(line)), self.path.open("a") as f:
                f.write(line)
        if self.trackers is not None:
            self.trackers.log(row)

    def close(self) -> None:
        """Close the trackers (their files complete)."""
        if self.trackers is not None:
            self.trackers.close()


class Progress:
    """A rich progress bar with loss, tokens/s and the step's communication (or nothing)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            self.bar = rich_progress.Progress(
                rich_progress.TextColumn("train"), rich_progress.BarColumn(),
                rich_progress.MofNCompleteColumn(), rich_progress.TimeRemainingColumn(),
                rich_progress.TextColumn("{task.fields[info]}"))
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
    # lazy: 1.2 s to import; only the end of a run draws
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


def report_file(what: str, write, *args):
    """`write(*args)` for a report file (loss.png, the trace), written after the final
    checkpoint: a storage failure there is a warning (the run itself is complete)."""
    try:
        return write(*args)
    except (OSError, RunFailed) as e:
        print(f"warning: {what} not written: {str(e).splitlines()[0] if str(e) else e!r}; "
              f"the run and its checkpoints are complete", file=sys.stderr, flush=True)
        return None
