"""Per-rank peak memory of data-parallel sharding and context parallelism, measured term
by term in real `tpkit train` steps, against the planner's prediction for the same layout.

    PYTHONPATH=src .venv/bin/python benchmarks/memory_sharded.py [--steps 3]

Model: llama-tiny widened (hidden 256, ffn 1024, 4 layers, 8 heads / 2 kv heads, vocab
256), fp32, seq 128, one micro-batch of 4 sequences per replica, tp = pp = 1. Layouts:
dp = 2 and 4 with none / ZeRO-1 / ZeRO-2 / FSDP after-forward / FSDP after-step, and
cp = 2 (dp = 1 and 2). What is measured on each rank, as the peak over the last step:

    weights      bytes of the storages the parameters live in (FSDP: the gathered units,
                 sized as they are at that moment) + the fp32 dp shards (ZeRO-1/2, FSDP)
    grads        the .grad tensors alive + the gradient shards (ZeRO-2, FSDP)
    optimizer    AdamW's exp_avg and exp_avg_sq (and step) tensors
    activations  the bytes saved for backward during one forward (a saved-tensors hook,
                 parameters' storages excluded, each storage counted once)

sampled after each layer's forward and as each parameter's gradient is accumulated
(before the unit's reduce-scatter). Predicted: `tpkit.plan.memory.memory_per_device`
at fp32 (`Precision.for_dtype("fp32")`: 4 + 4 + 8 bytes per parameter, 4 per activation
element), flash attention (torch's CPU attention saves only the log-sum-exp), tpkit's
eager block (`kernels="eager"`: unfused RMSNorm and SwiGLU, GQA's k/v repeated), no recompute:
what `tpkit plan --hardware local` prints for the layout (memory does not depend on the
hardware's speed). Step time: the median of the steps after the first (the "vs none"
ratio against the unsharded run of the same number of processes, in this run).
"""

from __future__ import annotations

import statistics

import torch

from common import environment, parser, print_table, write_json

MODEL = dict(hidden=256, ffn=1024, num_layers=4, num_heads=8, kv_heads=2,
             name="llama-tiny-wide")
SEQ, B = 128, 4
LAYOUTS = [  # name, dp, cp, train flags
    ("none", 2, 1, {}), ("zero1", 2, 1, dict(zero1=True)), ("zero2", 2, 1, dict(zero2=True)),
    ("fsdp", 2, 1, dict(fsdp=True)),
    ("fsdp after-step", 2, 1, dict(fsdp=True, fsdp_reshard="after-step")),
    ("fsdp after-step, m=2", 2, 1, dict(fsdp=True, fsdp_reshard="after-step", micro_batches=2)),
    ("cp=2", 1, 2, {}),
    ("none", 4, 1, {}), ("zero1", 4, 1, dict(zero1=True)), ("zero2", 4, 1, dict(zero2=True)),
    ("fsdp", 4, 1, dict(fsdp=True)),
    ("fsdp after-step", 4, 1, dict(fsdp=True, fsdp_reshard="after-step")),
    ("cp=2", 2, 2, {}), ("cp=2 + fsdp", 2, 2, dict(fsdp=True)),
]
TERMS = ("weights", "grads", "optimizer", "activations")


def model_config():
    """The widened llama-tiny."""
    from tpkit.spec import get_preset

    return get_preset("llama-tiny").with_(**MODEL)  # head_dim follows hidden: 32


def _storages(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class Meter:
    """Samples the four terms on this rank (see the module doc)."""

    def __init__(self, model) -> None:
        self.model, self.holder, self.peak = model, {}, dict.fromkeys(TERMS, 0)
        self.saved: dict[int, int] = {}
        for layer in model.layers.values():
            layer.register_forward_hook(lambda *_: self.sample())
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: self.sample())
        model.embed.register_forward_pre_hook(lambda *_: self.saved.clear())
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        if st.data_ptr() not in params and st.nbytes():
            self.saved[st.data_ptr()] = st.nbytes()
            self.peak["activations"] = max(self.peak["activations"], sum(self.saved.values()))
        return t

    def sample(self) -> None:
        units = getattr(self.holder.get("sharding"), "units", [])
        opt = self.holder.get("optimizer")
        masters = [p for g in getattr(getattr(opt, "inner", None), "param_groups", [])
                   for p in g["params"]] if opt is not None and units == [] else []
        weights = _storages(list(self.model.parameters()) + [u.shard for u in units] + masters)
        grads = _storages([p.grad for p in self.model.parameters()] +
                          [u.grad_shard for u in units])
        inner = getattr(opt, "inner", opt)
        state = [v for s in inner.state.values() for v in s.values()
                 if torch.is_tensor(v)] if inner is not None else []
        for k, v in (("weights", weights), ("grads", grads), ("optimizer", _storages(state))):
            self.peak[k] = max(self.peak[k], v)


def _worker(mesh, name: str, dp: int, cp: int, flags: dict, steps: int) -> dict:
    import tpkit.train.loop as loop
    from tpkit.model import Transformer
    from tpkit.train.config import TrainConfig

    m = flags.get("micro_batches", 1)
    batch = flags.get("global", B * dp * m)  # timing: the same global batch for every layout
    cfg = TrainConfig(preset="llama-tiny", dp=dp, cp=cp, steps=steps, micro_batches=m,
                      global_batch=batch, seq=SEQ, val_fraction=0.0, progress=False,
                      plot=False, checkpoint=False, out=f"/tmp/tpkit-memory-bench/{mesh.rank}",
                      **{k: v for k, v in flags.items() if k not in ("micro_batches", "global")})
    model = Transformer(model_config(), mesh, seed=0)
    meter = Meter(model)
    plain_build, plain_opt = loop.build_sharding, loop.build_optimizer

    def capture_sharding(*a, **kw):
        meter.holder["sharding"] = s = plain_build(*a, **kw)
        if s is not None:
            meter.holder["optimizer"] = s.optimizer
        return s

    def capture_opt(*a, **kw):
        meter.holder["optimizer"] = o = plain_opt(*a, **kw)
        return o

    loop.build_sharding, loop.build_optimizer = capture_sharding, capture_opt
    try:
        summary = loop.train(cfg, mesh, model)
    finally:
        loop.build_sharding, loop.build_optimizer = plain_build, plain_opt
    meter.sample()  # after the last step: the optimizer state exists
    return dict(peak=meter.peak, step_s=summary.later_step_s, loss=summary.losses[-1])


def predicted(dp: int, cp: int, flags: dict) -> dict:
    """The planner's memory terms for the layout (fp32, flash, no recompute)."""
    from tpkit.plan.layout import Layout
    from tpkit.plan.memory import Precision, memory_per_device

    zero = 3 if flags.get("fsdp") else 2 if flags.get("zero2") else 1 if flags.get("zero1") else 0
    lay = Layout(1, 1, dp, B, recompute="none", zero=zero, cp=cp,
                 fsdp_reshard=flags.get("fsdp_reshard", "after-forward"))
    got = memory_per_device(model_config(), SEQ, lay, flags.get("micro_batches", 1),
                            Precision.for_dtype("fp32"), kernels="eager")
    return {"weights": got["weights"], "grads": got["grads"], "optimizer": got["optimizer"],
            "activations": got["activations"]}


TIMED = [("none", 2, 1, {}), ("zero2", 2, 1, dict(zero2=True)), ("fsdp", 2, 1, dict(fsdp=True)),
         ("fsdp after-step", 2, 1, dict(fsdp=True, fsdp_reshard="after-step")),
         ("cp=2", 1, 2, {})]


def timing(rounds: int, steps: int) -> None:
    """Step time of 2-process layouts against plain dp=2, in rounds that rotate the order
    (the same model and batch: dp=2 splits the 8 sequences, cp=2 each sequence)."""
    from tpkit.launch import spawn

    times: dict[str, list[float]] = {name: [] for name, *_ in TIMED}
    for r in range(rounds):
        for i in range(len(TIMED)):
            name, dp, cp, flags = TIMED[(r + i) % len(TIMED)]
            got = spawn(_worker, dp * cp, name, dp, cp, {**flags, "global": 8}, steps,
                        mesh=dict(dp=dp, cp=cp), threads=1)
            times[name].append(statistics.median(x["step_s"] for x in got))
    base = statistics.median(times["none"])
    rows = [[name, f"{statistics.median(t) * 1e3:.0f}", f"{statistics.median(t) / base:.2f}"]
            for name, t in times.items()]
    print_table(f"step time, 2 processes, median of {rounds} rounds x {steps - 1} steps",
                ["layout", "step ms", "vs plain dp=2"], rows)
    write_json("memory_sharded_timing", dict(environment=environment(), times=times))


def main() -> None:
    """Run every layout, print measured vs predicted per term, and the step times."""
    from tpkit.launch import spawn

    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=4, help="steps per layout (default: 4)")
    p.add_argument("--timing-rounds", type=int, default=0,
                   help="only time the 2-process layouts, this many rotating rounds")
    args = p.parse_args()
    steps = args.steps
    if args.timing_rounds:
        return timing(args.timing_rounds, steps)
    rows, out = [], []
    base: dict[int, float] = {}
    for name, dp, cp, flags in LAYOUTS:
        got = spawn(_worker, dp * cp, name, dp, cp, flags, steps, mesh=dict(dp=dp, cp=cp),
                    threads=1)
        peak = {k: max(r["peak"][k] for r in got) for k in TERMS}
        want = predicted(dp, cp, flags)
        step = statistics.median(r["step_s"] for r in got)
        if name == "none":
            base[dp * cp] = step
        ratio = step / base[dp * cp] if dp * cp in base else float("nan")
        rows.append([f"dp={dp} cp={cp}", name] +
                     [f"{peak[k] / 2**20:.2f} / {want[k] / 2**20:.2f} ({peak[k] / want[k] - 1:+.0%})"
                      for k in TERMS] + [f"{step * 1e3:.0f}", f"{ratio:.2f}"])
        out.append(dict(layout=name, dp=dp, cp=cp, measured=peak, predicted=want, step_s=step,
                        ratio_vs_none=ratio))
    print_table("per-rank peak MiB, measured / predicted (difference)",
                ["layout", "sharding"] + list(TERMS) + ["step ms", "vs none"], rows)
    write_json("memory_sharded", dict(environment=environment(), rows=out))


if __name__ == "__main__":
    main()
