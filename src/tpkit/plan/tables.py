"""Rich tables for `tpkit plan`: the ranked plans with a legend, the commands to run the
best one, and the per-layer breakdown (--explain)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from tpkit.plan.command_line import (
    AFTER_STEP_NOTE,
    TrainModel,
    megatron_flags,
    tpkit_command,
    tpkit_gaps,
)
from tpkit.plan.layout import ZERO_NAMES, ZERO_SHORT
from tpkit.plan.planner import Request
from tpkit.plan.reasons import gb
from tpkit.plan.simulate import Estimate

GB = 1e9

# Every column of the table, explained (also printed by `tpkit plan --help`).
COLUMNS = {
    "#": "rank, fastest first (the best plan of each (tp, cp, pp) unless --all)",
    "tp": "tensor-parallel size: each layer's matrices split over tp GPUs of one node",
    "cp": "context-parallel size: each sequence split over cp GPUs (ring attention)",
    "pp": "pipeline stages: consecutive layers per stage, 1F1B schedule",
    "dp": "data-parallel replicas, each a slice of the global batch",
    "mb": "micro-batch size (sequences per forward); micro-batches per step = batch/(dp mb)",
    "options": "rc: recompute (- none, sel selective, full); sp: sequence parallel; "
               "z1/z2/fsdp: ZeRO-1/ZeRO-2/FSDP sharding over dp x cp (fsdp-step: FSDP that "
               "keeps the gathered weights for the step, --fsdp-reshard after-step); "
               "vN: N interleaved chunks; "
               "ends-1: one layer fewer on the first and last pipeline stages",
    "step s": "predicted seconds per optimizer step",
    "tokens/s": "global batch x sequence / step time, whole cluster",
    "TF/dev": "model TFLOP/s per device (6 x params x tokens + attention; no recompute)",
    "MFU": "model FLOP utilisation: TF/dev over the device's dense bf16 peak",
    "GB": "predicted peak memory of the fullest device (weights, grads, optimizer, "
          "activations), against the usable share of its memory",
}


def legend() -> str:
    """One line per column: what it means."""
    return "\n".join(f"  {k:>9}  {v}" for k, v in COLUMNS.items())


def _options(e: Estimate) -> str:
    lay = e.layout
    out = [{"none": "-", "selective": "sel", "full": "full"}[lay.recompute]]
    out += ["sp"] if lay.sp else []
    out += [ZERO_SHORT[lay.zero] + ("-step" if lay.keeps_gathered_weights else "")] \
        if lay.zero else []
    out += [f"v{lay.interleave}"] if lay.interleave > 1 else []
    out += ["ends-1"] if lay.lighter_ends else []
    return " ".join(out)


def _layout(e: Estimate) -> str:
    lay = e.layout
    return (f"tp={lay.tp} cp={lay.cp} pp={lay.pp} dp={lay.dp} mb={lay.micro_batch} "
            f"{_options(e)}")


def _gb_cell(nbytes: float) -> str:
    return gb(nbytes).removesuffix(" GB")


def print_table(req: Request, plans: list[Estimate], console: Console | None = None) -> None:
    """The ranked plans: step time, tokens/s, TFLOP/s per device, MFU, memory, reason."""
    console = console or Console(width=max(Console().width, 120))
    c, cl = req.config, req.cluster
    acc = cl.hardware.accelerator
    n = c.num_params()
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    title = (f"{c.name} ({size}) on {cl.nodes} x {cl.per_node} {acc.name} "
             f"({cl.hardware.name}); seq {req.seq}, global batch {req.global_batch}")
    t = Table(title=title, show_lines=False)
    for col in COLUMNS:
        t.add_column(col, justify="left" if col == "options" else "right", no_wrap=True)
    for i, e in enumerate(plans, 1):
        lay = e.layout
        t.add_row(str(i), str(lay.tp), str(lay.cp), str(lay.pp), str(lay.dp),
                  str(lay.micro_batch), _options(e), f"{e.step_time_s:.3g}",
                  f"{e.tokens_per_s:,.0f}", f"{e.tflops_per_device:.3g}", f"{e.mfu:.0%}",
                  _gb_cell(e.memory["total"]))
    console.print(t)
    for i, e in enumerate(plans, 1):  # reasons below: a sentence reads badly in a narrow cell
        console.print(f"{i:>2}. {e.reason}", highlight=False)
    console.print("Columns:\n" + legend(), highlight=False)


def print_commands(req: Request, shown: list[Estimate], runnable: Estimate | None,
                   model: TrainModel, console: Console | None = None) -> None:
    """How to run plan #1: Megatron-LM flags, and tpkit's command for it (or for the best
    plan tpkit can run, `runnable`, saying what plan #1 needs that tpkit lacks)."""
    console = console or Console(width=max(Console().width, 120))
    best, cl = shown[0], req.cluster
    grad = req.precision.grad if req.precision else 4
    say = console.print
    say("Run plan #1 with Megatron-LM (pretrain_gpt.py):", highlight=False)
    say("  " + megatron_flags(best.layout, req.seq, req.global_batch, req.config.num_layers,
                              grad, cl.flash_attention, cl.hardware.accelerator.dtype != "fp32"),
        highlight=False, soft_wrap=True)
    if best.layout.keeps_gathered_weights:
        say("  (" + AFTER_STEP_NOTE + ")", highlight=False, soft_wrap=True)
    gaps = tpkit_gaps(best.layout)
    if not gaps:
        say("Run plan #1 with tpkit:", highlight=False)
    elif runnable is None:
        say(f"tpkit cannot run plan #1 ({', '.join(gaps)}) nor any plan that fits",
            highlight=False)
        return
    else:
        where = next((f"#{i}" for i, e in enumerate(shown, 1) if e is runnable),
                     _layout(runnable))
        say(f"tpkit cannot run plan #1 ({', '.join(gaps)}); the best plan it can run is "
            f"{where}, {runnable.step_time_s / best.step_time_s - 1:+.0%} step time, "
            f"{gb(runnable.memory['total'])}:", highlight=False)
    bf16 = cl.hardware.accelerator.dtype != "fp32"
    local = cl.hardware.name in ("cpu", "local")
    say("  " + tpkit_command(model, runnable.layout if gaps else best.layout, req.seq,
                             req.global_batch, cl.nodes, cl.per_node, bf16, local),
        highlight=False, soft_wrap=True)
    if model.note:
        say(f"  (where {model.note})", highlight=False, soft_wrap=True)


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
        mem.add_row(k, _gb_cell(v))
    console.print(t, steps, mem)


def plan_dict(e: Estimate) -> dict:
    """One plan as JSON-able dict (the keys scripts rely on, then the breakdown)."""
    lay = e.layout
    return {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp,
            "micro_batch": lay.micro_batch, "sp": lay.sp, "recompute": lay.recompute,
            "zero": lay.zero, "dp_sharding": ZERO_NAMES[lay.zero], "zero1": lay.zero1,
            "fsdp_reshard": lay.fsdp_reshard if lay.zero >= 3 else None,
            "lighter_ends": lay.lighter_ends,
            "interleave": lay.interleave, "micro_batches": e.micro_batches,
            "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s,
            "tflops_per_device": e.tflops_per_device, "mfu": e.mfu,
            "memory_gb": e.memory["total"] / GB, "reason": e.reason,
            "terms_s": e.terms, "memory_breakdown_gb": {k: v / GB for k, v in e.memory.items()},
            "per_layer_s": e.per_layer}


def commands_dict(req: Request, e: Estimate, model: TrainModel) -> dict:
    """The tpkit and Megatron-LM command lines of one plan (tpkit's None if it cannot)."""
    cl, lay = req.cluster, e.layout
    gaps = tpkit_gaps(lay)
    tpkit = None if gaps else tpkit_command(
        model, lay, req.seq, req.global_batch, cl.nodes, cl.per_node,
        cl.hardware.accelerator.dtype != "fp32", cl.hardware.name in ("cpu", "local"))
    return {"tpkit": tpkit, "tpkit_missing": gaps, "tpkit_placeholders": model.note,
            "note": AFTER_STEP_NOTE if lay.keeps_gathered_weights else None,
            "megatron": megatron_flags(lay, req.seq, req.global_batch, req.config.num_layers,
                                       req.precision.grad if req.precision else 4,
                                       cl.flash_attention, cl.hardware.accelerator.dtype != "fp32")}
