"""Plain-text tables of ledger summaries (rendered with rich, returned as a string)."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render(table: Table, width: int = 120) -> str:
    """A rich table as plain text."""
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(table)
    return buf.getvalue()


def render_summary(rows: list[dict], title: str) -> str:
    """Ledger summary rows (see `Ledger.summary`) as a table."""
    t = Table(title=title)
    for col in ("scope", "group", "op", "phase", "count", "elements each", "bytes",
                "wire bytes/rank", "ms"):
        t.add_column(col, justify="left" if col in ("scope", "group", "op", "phase") else "right")
    for r in rows:
        t.add_row(r["scope"] or "-", f"{r['group']}", r["op"], r["phase"], str(r["count"]),
                  f"{r['numel']:,}", human_bytes(r["nbytes"]), human_bytes(r["wire_bytes"]),
                  f"{1000 * r['seconds']:.2f}")
    if not rows:
        t.add_row("-", "-", "(nothing sent)", "-", "0", "0", "0 B", "0 B", "0.00")
    return render(t)
