"""The PNG of one step's trace: a row per (rank, track), a colour per kind of work."""

from __future__ import annotations

from pathlib import Path

COLORS = {"compute": "#4c72b0", "tp": "#dd8452", "tp async": "#f2b880", "overlap": "#55a868",
          "bubble": "#c44e52", "pp": "#8172b3", "dp": "#937860", "other": "#999999"}
LABELS = {"compute": "compute", "tp": "tp collective (blocking)",
          "tp async": "dX all-reduce in flight", "overlap": "dW matmul under it",
          "bubble": "bubble (waiting on a recv)", "pp": "pipeline send/recv",
          "dp": "dp collective (buckets, FSDP gathers)", "other": "other collective"}


def plot_step(events: list[dict], path: Path, title: str = "") -> Path:
    """Draw the events (Chrome trace 'X' events, µs) of every rank; returns `path`."""
    # lazy: 1.2 s to import; only --trace draws
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    ranks = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    timed = [e for e in events if e["ph"] == "X"]
    rows = sorted({(e["pid"], e["tid"]) for e in timed})
    fig, ax = plt.subplots(figsize=(13, 0.45 * len(rows) + 1.6))
    for y, key in enumerate(rows):
        for cat, color in COLORS.items():
            spans = [(e["ts"] / 1e3, max(e["dur"], 1.0) / 1e3) for e in timed
                     if (e["pid"], e["tid"]) == key and e["cat"] == cat]
            if spans:
                ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=color)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{ranks.get(p, p)} · {names.get((p, t), t)}" for p, t in rows],
                       fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    used = {e["cat"] for e in timed}
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in COLORS.items() if k in used]
    fig.legend(handles, [LABELS[k] for k in COLORS if k in used], fontsize=7, ncol=8,
               loc="lower center", frameon=False)
    ax.set_title(title or "one training step, per rank", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
