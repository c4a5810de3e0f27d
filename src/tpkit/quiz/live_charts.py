"""Chart specifications for the live demonstrations, drawn as SVG by the web page.

    bars("Bytes sent", "B", [bar("column -> row", 1024, "1024 B", "g0")])
    grid("3D grid", [row("dp0", [cell("0", 0), cell("1", 1)])], per_node=2, node="node")
    matrices("MLP weights", [matrix("A", [16, 64], "cols", 4)])
    sums("Z = Y1B1 + Y2B2", [term("Y1B1", [0.1, -0.2], 0)], term("Z", [..], "ok"), check)

A chart is a small JSON-able dict that names its `kind`; the page has one drawing
function per kind (`page/charts.js`) and draws every number it is given as a label, so
a chart says what the demonstration computed and nothing else. Colours name ranks
(0..3, the page's four GPU colours) or roles: "comm", "muted", "ok", "ref".
Pure Python, no torch.
"""

from __future__ import annotations

Chart = dict


def bar(label: str, value: float, text: str, color: int | str = 0,
        ref: float | None = None) -> dict:
    """One bar: its label, length (in the chart's unit), the number printed, a colour,
    and optionally a theory mark `ref` drawn across it."""
    out = dict(label=label, value=float(value), text=text, color=_color(color))
    if ref is not None:
        out["ref"] = float(ref)
    return out


def bars(title: str, unit: str, items: list[dict], ref_label: str = "") -> Chart:
    """Horizontal bars on one scale (times, bytes), each labelled with its number."""
    return dict(kind="bars", title=title, unit=unit, bars=items, ref_label=ref_label)


def cell(text: str, color: int | str) -> dict:
    """One rank (or head) of a grid, coloured by its group."""
    return dict(text=text, color=_color(color))


def row(label: str, cells: list[dict]) -> dict:
    """One row of a grid (a dp replica, a placement)."""
    return dict(label=label, cells=cells)


def grid(title: str, rows: list[dict], per_node: int, node: str) -> Chart:
    """Ranks in rows, with a frame around every `per_node` consecutive ranks (a node)."""
    return dict(kind="grid", title=title, rows=rows, per_node=per_node, node=node)


def matrix(label: str, shape: list[int], split: str, parts: int) -> dict:
    """A weight matrix [rows, cols] cut into `parts` slices by "cols" or "rows"."""
    if split not in ("cols", "rows"):
        raise ValueError(f"split={split!r} must be 'cols' or 'rows'")
    return dict(label=label, shape=list(shape), split=split, parts=parts)


def matrices(title: str, mats: list[dict]) -> Chart:
    """Matrices side by side, each slice coloured by the rank that holds it."""
    return dict(kind="matrices", title=title, mats=mats)


def term(label: str, values: list[float], color: int | str) -> dict:
    """One row of numbers (a rank's partial output, their sum, the reference)."""
    return dict(label=label, values=[round(float(v), 4) for v in values], color=_color(color))


def sums(title: str, terms: list[dict], result: dict, check: dict | None = None) -> Chart:
    """Terms that add up: each a row of values, then '=' the result (and a reference)."""
    return dict(kind="sums", title=title, terms=terms, result=result, check=check)


def _color(c: int | str) -> str:
    return f"g{c % 4}" if isinstance(c, int) else c
