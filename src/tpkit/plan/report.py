"""Rich tables for `tpkit plan`: the ranked plans, and the per-layer breakdown (--explain)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from tpkit.plan.planner import Request
from tpkit.plan.simulate import Estimate

GB = 1e9


def _options(e: Estimate) -> str:
    lay = e.layout
    out = [{"none": "-", "selective": "sel", "full": "full"}[lay.recompute]]
    out += ["sp"] if lay.sp else []
    out += ["z1"] if lay.zero1 else []
    out += [f"v{lay.interleave}"] if lay.interleave > 1 else []
    return " ".join(out)


def _layout(e: Estimate) -> str:
    lay = e.layout
    return f"tp={lay.tp} pp={lay.pp} dp={lay.dp} mb={lay.micro_batch} {_options(e)}"


def print_table(req: Request, plans: list[Estimate], console: Console | None = None) -> None:
    """The ranked plans: step time, tokens/s, TFLOP/s per device, MFU, memory, reason."""
    console = console or Console(width=max(Console().width, 120))
    c, cl = req.config, req.cluster
    acc = cl.hardware.accelerator
    title = (f"{c.name} ({c.num_params() / 1e9:.1f}B) on {cl.nodes} x {cl.per_node} {acc.name} "
             f"({cl.hardware.name}); seq {req.seq}, global batch {req.global_batch}")
    t = Table(title=title, show_lines=False)
    cols = ("#", "tp", "pp", "dp", "mb", "rc sp z1 v", "step s", "tokens/s", "TF/dev", "MFU",
            "GB")
    for col in cols:
        t.add_column(col, justify="left" if col.startswith("rc") else "right", no_wrap=True)
    for i, e in enumerate(plans, 1):
        lay = e.layout
        t.add_row(str(i), str(lay.tp), str(lay.pp), str(lay.dp), str(lay.micro_batch),
                  _options(e), f"{e.step_time_s:.3g}", f"{e.tokens_per_s:,.0f}",
                  f"{e.tflops_per_device:.3g}", f"{e.mfu:.0%}", f"{e.memory['total'] / GB:.1f}")
    console.print(t)
    for i, e in enumerate(plans, 1):  # reasons below: a sentence reads badly in a narrow cell
        console.print(f"{i:>2}. {e.reason}", highlight=False)


def print_explain(req: Request, e: Estimate, console: Console | None = None) -> None:
    """Per-layer (one micro-batch) times, per-step terms, and memory of one plan."""
    console = console or Console(width=max(Console().width, 120))
    t = Table(title=f"{_layout(e)}: one layer, one micro-batch, one rank")
    t.add_column("per layer")
    t.add_column("ms", justify="right")
    for k, v in e.per_layer.items():
        t.add_row(k.replace("_", " "), f"{v * 1e3:.3f}")
    steps = Table(title="per step")
    steps.add_column("term")
    steps.add_column("s", justify="right")
    steps.add_column("share", justify="right")
    for k, v in e.terms.items():
        steps.add_row(k.replace("_", " "), f"{v:.4g}", f"{v / e.step_time_s:.1%}")
    steps.add_row("step", f"{e.step_time_s:.4g}", "100%")
    mem = Table(title="memory, fullest device")
    mem.add_column("kind")
    mem.add_column("GB", justify="right")
    for k, v in e.memory.items():
        mem.add_row(k, f"{v / GB:.2f}")
    console.print(t, steps, mem)


def plan_dict(e: Estimate) -> dict:
    """One plan as JSON-able dict (the keys scripts rely on, then the breakdown)."""
    lay = e.layout
    return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "micro_batch": lay.micro_batch,
            "sp": lay.sp, "recompute": lay.recompute, "zero1": lay.zero1,
            "interleave": lay.interleave, "micro_batches": e.micro_batches,
            "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s,
            "tflops_per_device": e.tflops_per_device, "mfu": e.mfu,
            "memory_gb": e.memory["total"] / GB, "reason": e.reason,
            "terms_s": e.terms, "memory_breakdown_gb": {k: v / GB for k, v in e.memory.items()},
            "per_layer_s": e.per_layer}
