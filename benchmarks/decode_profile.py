"""Where the milliseconds of one decoded token go: `tpkit generate`'s path (the serving
engine on rank 0, `Runner.follow` on the others) at tp=1 and tp=2, GPT-2 124M shape,
random weights, greedy, batch 1 and 8.

    .venv/bin/python benchmarks/decode_profile.py [--folder HF_DIR] [--tokens 48]
                                                   [--tp 1,2] [--batch 1,8] [--quantize int8]

Per (tp, batch): the wall time of a decode step (median over the steps, no profiler),
then the same steps under torch.profiler, each millisecond put in one bucket by the
op that spent it (self time):
    matmul      aten addmm / mm / bmm / linear / _weight_int8pack_mm, and the native
                products outside the layer stack (`decode_ops.Operand`: the head)
    layers      the native layer stack (`decode_ops.run_layers`: every layer's products,
                attention, norms and rotary in one call), less its all-reduces
    attention   scaled_dot_product_attention and its kernel, the KV cache writes
    all-reduce  the shared-memory (or gloo) all-reduces of the layers, waits included
                (those the native stack runs: their spans, as the ledger records them)
    plan        rank 0's broadcast of the step to the followers (`serve.plan`)
    gather      the all-gather of the last logits (greedy: each rank's best)
    sampling    greedy / sampling (at tp > 1 greedy runs on every rank's vocabulary
                shard: `paged_kv._greedy`, its head matmul counted as matmul), and
                rank 0's token bookkeeping (`Engine._push`)
    other ops   every other aten op (norms, adds, gelu, copies, indexing)
    python      what is left of the unprofiled wall time: the interpreter and
                torch's dispatcher between the ops
The profiler's own cost lands in the ops it times, not in `python` (which is taken
from the unprofiled run). Rank 0's figures decide the token; the follower's are
shown too. Writes bench-results/decode_profile.json.
"""

from __future__ import annotations

import bisect
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import environment, parser, print_table, write_json

BUCKETS = ("matmul", "layers", "attention", "all-reduce", "plan", "gather", "sampling",
           "other ops", "python")
NATIVE_REDUCE = [0.0]  # seconds of the native stack's all-reduces since the last reset
MATMUL = ("aten::addmm", "aten::mm", "aten::bmm", "aten::_weight_int8pack_mm",
          "mkldnn::_linear_pointwise")
ATTENTION = ("sdpa", "flash_attention", "scaled_dot_product", "aten::index_put")
PROMPT = list(range(1, 9))
DTYPE = ["float32"]  # --dtype (read by the spawned ranks too: they fork)


def save_gpt2(folder: Path) -> Path:
    """A random GPT-2 124M saved as a Hugging Face folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(folder)
    return folder


def _label_comm() -> None:
    """Name every collective and rank 0's sampling in the profile (record_function)."""
    import torch.distributed as dist

    from tpkit.comm import collectives
    from tpkit.comm.shm import ShmChannel
    from tpkit.decode import paged_kv
    from tpkit.kernels import decode_ops
    from tpkit.serve import engine, output

    if getattr(ShmChannel, "_labelled", False):
        return
    ShmChannel._labelled = True

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def labelled(*a, **k):
            with torch.profiler.record_function(label(*a, **k) if callable(label) else label):
                return fn(*a, **k)
        setattr(owner, name, labelled)

    wrap(ShmChannel, "all_reduce", "tpk.all-reduce")
    wrap(ShmChannel, "all_gather", "tpk.gather")
    wrap(ShmChannel, "broadcast", "tpk.plan")
    wrap(dist, "broadcast", "tpk.plan")  # int64 plans over gloo, where shm does not take them
    wrap(dist, "all_reduce", "tpk.all-reduce")
    wrap(paged_kv, "_greedy", "tpk.sampling")
    wrap(output.OutputProcessor, "push", "tpk.sampling")
    wrap(engine.Engine, "_take", "tpk.sampling")
    wrap(decode_ops, "run_layers", "tpk.layers")
    wrap(decode_ops.Operand, "_run", "tpk.matmul")
    record = collectives.record_native

    def counted(group, op, x, spans, scopes, phase="forward"):
        NATIVE_REDUCE[0] += sum(b - a for a, b in spans)
        return record(group, op, x, spans, scopes, phase)
    collectives.record_native = counted


def _bucket(name: str) -> str:
    if name.startswith("tpk."):
        return name[4:]
    if name in MATMUL or name == "aten::linear":
        return "matmul"
    if any(a in name for a in ATTENTION):
        return "attention"
    return "other ops"


def _self_ms(prof, steps: int) -> dict[str, float]:
    """Self CPU time per bucket, ms per step. Ops inside a labelled region (a collective,
    the sampling) count for that region; the native stack's all-reduces (NATIVE_REDUCE
    since the profile began) move from its region to all-reduce."""
    out = dict.fromkeys(BUCKETS, 0.0)
    out["layers"] -= NATIVE_REDUCE[0] * 1e3
    out["all-reduce"] += NATIVE_REDUCE[0] * 1e3
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    labelled = sorted((e.time_range.start, e.time_range.end, e.name[4:]) for e in events
                      if e.name.startswith("tpk."))
    starts = [a for a, _, _ in labelled]
    inner = [0.0] * len(labelled)  # self time of the aten ops inside each region
    for e in events:
        if e.name.startswith("ProfilerStep") or e.name.startswith("tpk."):
            continue
        t = e.time_range.start
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and t >= labelled[i][1] and i > bisect.bisect_right(starts, t) - 4:
            i -= 1  # past a nested region's end: the region around it (nesting depth 2)
        if i >= 0 and t < labelled[i][1]:  # inside a labelled region
            lab = labelled[i][2]
            if lab == "sampling" and _bucket(e.name) != "other ops":
                lab = _bucket(e.name)  # the greedy step's head matmul is a matmul
            out[lab] += e.self_cpu_time_total / 1e3
            inner[i] += e.self_cpu_time_total
        else:
            out[_bucket(e.name)] += e.self_cpu_time_total / 1e3
    for i, ((a, b, lab), children) in enumerate(zip(labelled, inner)):
        nested = 0.0  # labelled regions inside this one count for themselves
        for a2, b2, _ in labelled[i + 1:i + 4]:
            if a2 < b and b2 <= b:
                nested += b2 - a2
        out[lab] += max(0.0, (b - a) - children - nested) / 1e3  # its own time (ctypes)
    return {k: v / steps for k, v in out.items()}


def _case(mesh, folder: str, batch: int, tokens: int, quantize: str | None) -> dict:
    from tpkit.serve import Engine, SamplingParams
    from tpkit.serve.runner import Runner
    from tpkit.weights.sources import load_model, open_source

    _label_comm()
    model = load_model(open_source(folder), mesh, dtype=getattr(torch, DTYPE[0]), decode=True,
                       quantize=quantize)  # as `tpkit generate` loads it
    runs = 3  # warm-up, timed, profiled
    if mesh.tp_rank != 0:
        for _ in range(runs):
            Runner(model).follow()
        return {}
    result = {}
    for run in range(runs):
        runner = Runner(model)
        engine = Engine(model, max_batch=batch, max_len=128, runner=runner)
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        reqs = [engine.submit([p + i for p in PROMPT], params) for i in range(batch)]
        engine.step()  # the prefills and the first decode
        steps = []
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
            if run == 2 else None
        if prof:
            NATIVE_REDUCE[0] = 0.0
            prof.__enter__()
        while engine.busy:
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        if prof:
            prof.__exit__(None, None, None)
            result["profile_ms"] = _self_ms(prof, len(steps))
        elif run == 1:
            result["step_ms"] = statistics.median(steps) * 1e3
        assert all(len(r.result().tokens) == tokens for r in reqs)
        runner.lead_stop()
    return result


def _follower_case(mesh, folder, batch, tokens, quantize) -> dict:
    """The same run, profiled on the follower (rank 1) instead."""
    from tpkit.serve import Engine, SamplingParams
    from tpkit.serve.runner import Runner
    from tpkit.weights.sources import load_model, open_source

    _label_comm()
    model = load_model(open_source(folder), mesh, dtype=getattr(torch, DTYPE[0]), decode=True,
                       quantize=quantize)  # as `tpkit generate` loads it
    if mesh.tp_rank == 0:
        engine = Engine(model, max_batch=batch, max_len=128)
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.submit([p + i for p in PROMPT], params)
        while engine.busy:
            engine.step()
        engine.runner.lead_stop()
        return {}
    NATIVE_REDUCE[0] = 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        steps = Runner(model).follow()
    return {"profile_ms": _self_ms(prof, steps)}


def run_case(folder: str, tp: int, batch: int, tokens: int, quantize: str | None) -> dict:
    """Rank 0's wall time and buckets (and at tp > 1 the follower's buckets)."""
    from tpkit.launch import spawn
    from tpkit.mesh import ParallelMesh

    if tp == 1:
        lead = _case(ParallelMesh.single(), folder, batch, tokens, quantize)
        follower = None
    else:
        lead = spawn(_case, tp, folder, batch, tokens, quantize, mesh=dict(tp=tp),
                     timeout=1800)[0]
        follower = spawn(_follower_case, tp, folder, batch, tokens, quantize,
                         mesh=dict(tp=tp), timeout=1800)[1]
    prof = lead["profile_ms"]
    prof["python"] = max(0.0, lead["step_ms"] - sum(v for k, v in prof.items() if k != "python"))
    return dict(tp=tp, batch=batch, step_ms=lead["step_ms"], lead=prof,
                follower=follower and follower["profile_ms"])


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--folder", default=None, help="a GPT-2 HF folder (default: a random one)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--tp", default="1,2")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--quantize", default=None)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    DTYPE[0] = args.dtype
    load = [Path("/proc/loadavg").read_text().split()[:3]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or str(save_gpt2(Path(tmp) / "gpt2"))
        for batch in map(int, args.batch.split(",")):
            for tp in map(int, args.tp.split(",")):
                r = run_case(folder, tp, batch, args.tokens, args.quantize)
                rows.append(r)
                print(f"tp={tp} batch={batch}: {r['step_ms']:.1f} ms/step "
                      + " ".join(f"{k}={v:.1f}" for k, v in r["lead"].items()), flush=True)
    load.append(Path("/proc/loadavg").read_text().split()[:3])
    table = []
    for r in rows:
        for who in ("lead", "follower"):
            if r[who]:
                table.append([str(r["tp"]), str(r["batch"]), "rank 0" if who == "lead" else
                              "rank 1", f"{r['step_ms']:.1f}" if who == "lead" else "",
                              *(f"{r[who][b]:.2f}" if b in r[who] else "" for b in BUCKETS)])
    print_table(f"ms per decode step (load {load[0]} -> {load[1]})",
                ["tp", "batch", "rank", "wall", *BUCKETS], table)
    print(f"wrote {write_json('decode_profile', dict(environment=environment(), load=load, rows=rows))}")


if __name__ == "__main__":
    main()
