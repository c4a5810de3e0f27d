"""The planner: enumerate layouts, drop what does not fit, rank by predicted step time.

    for tp in divisors(devices)        (heads, kv heads and ffn must split over tp)
      for cp in 1, 2, 4, ...           (each rank keeps >= 1024 tokens; 2 cp chunks divide s)
        for pp in divisors(devices / (tp cp))   (at most one layer per stage)
          dp = devices / (tp cp pp)    (the global batch must split over dp)
          for micro-batch, sequence parallelism, recomputation, data-parallel sharding
          (none, ZeRO-1, ZeRO-2, FSDP after-forward or after-step), interleaving
          (2, 4, 8, ... chunks that split the layers evenly), lighter first/last stages:
              simulate; keep it if its fullest device fits in memory

Plans are ranked by step time (the global batch is fixed, so by tokens/s), the best
of each (tp, pp) kept, and each gets a one-line reason (see `reasons.py`). A request
that nothing satisfies raises `PlanError` naming the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpkit.plan.layout import ZERO_NAMES
from tpkit.plan.memory import Precision, chunks_split_evenly, lighter_end_layers
from tpkit.plan.reasons import explain
from tpkit.plan.simulate import Cluster, Estimate, Layout, evaluate
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import UserError
from tpkit.spec.grid import weight_replicas, world_of
from tpkit.spec.theory import FSDP_RESHARD, RECOMPUTE

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
CHOICES = ("tp", "cp", "pp", "dp", "micro_batch", "sp", "recompute", "zero", "interleave",
           "lighter_ends", "fsdp_reshard")
MIN_TOKENS_PER_CP_RANK = 1024  # smaller chunks leave too little attention to hide the ring


class PlanError(UserError):
    """No plan satisfies the request; the message names the numbers that rule them out."""


@dataclass(frozen=True)
class Request:
    """A model, its sequence length and global batch (sequences per step), and a cluster."""

    config: ModelConfig
    seq: int
    global_batch: int
    cluster: Cluster
    fixed: dict = field(default_factory=dict)  # pin any of CHOICES, e.g. {"tp": 8}
    precision: Precision | None = None  # None: the hardware's dtype, fp32 main gradients


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _options(req: Request, name: str, default: list) -> list:
    if name in req.fixed and req.fixed[name] is not None:
        return [req.fixed[name]]
    return default


def _degrees(req: Request, rejected: dict[str, str]) -> list[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) the model and the batch admit; others go to `rejected`."""
    c, n = req.config, req.cluster.devices
    out = []
    for tp in _options(req, "tp", divisors(n)):
        problems = c.problems(tp=tp, seq=req.seq) if n % tp == 0 else [
            f"tp={tp} does not divide {n} devices"]
        if problems:
            rejected.setdefault(f"tp={tp}", "; ".join(problems))
            continue
        for cp in _options(req, "cp", _cp_sizes(req.seq, n // tp)):
            for pp in _options(req, "pp", divisors(n // tp // cp) if n % (tp * cp) == 0 else [1]):
                dp = n // world_of(tp, pp, 1, cp)
                why = _cp_problem(req.seq, cp) or _degree_problem(req, tp, cp, pp, dp)
                if why:
                    rejected.setdefault(f"tp={tp} cp={cp} pp={pp}", why)
                    continue
                out.append((tp, cp, pp, dp))
    return out


def _cp_sizes(seq: int, devices: int) -> list[int]:
    """Context-parallel sizes worth trying: powers of 2 leaving each rank >= 1024 tokens."""
    out, cp = [], 1
    while cp <= devices and devices % cp == 0 and (cp == 1 or seq // cp >= MIN_TOKENS_PER_CP_RANK):
        out.append(cp)
        cp *= 2
    return out


def _cp_problem(seq: int, cp: int) -> str | None:
    if cp > 1 and seq % (2 * cp):  # causal load balance: 2 chunks per rank (Megatron)
        return f"sequence {seq} is not divisible by 2*cp = {2 * cp}"
    return None


def _degree_problem(req: Request, tp: int, cp: int, pp: int, dp: int) -> str | None:
    n, layers = req.cluster.devices, req.config.num_layers
    if world_of(tp, pp, dp, cp) != n:
        return f"tp*cp*pp = {tp}*{cp}*{pp} does not divide {n} devices"
    if pp > layers:
        return f"pp={pp} stages is more than num_layers={layers}"
    if "dp" in req.fixed and req.fixed["dp"] not in (None, dp):
        return f"dp would be {dp}, not the requested {req.fixed['dp']}"
    if req.global_batch % dp:
        return f"global batch {req.global_batch} is not divisible by dp={dp}"
    return None


def candidates(req: Request) -> tuple[list[Layout], dict[str, str]]:
    """Every layout to simulate, and why the (tp, pp) pairs left out were left out."""
    rejected: dict[str, str] = {}
    out = []
    for tp, cp, pp, dp in _degrees(req, rejected):
        per_replica = req.global_batch // dp
        mbs = [b for b in _options(req, "micro_batch", list(MICRO_BATCHES)) if per_replica % b == 0]
        if not mbs:
            rejected.setdefault(f"tp={tp} pp={pp}", f"micro-batch does not divide the "
                                f"{per_replica} sequences per replica")
        found = [lay for mb in mbs for lay in _variants(req, (tp, cp, pp, dp), mb,
                                                       per_replica // mb)]
        if mbs and not found:
            rejected.setdefault(f"tp={tp} pp={pp}", f"interleave={req.fixed.get('interleave')}:"
                                f" {req.config.num_layers} layers (+2 with lighter ends) do "
                                f"not split into {pp} x {req.fixed.get('interleave')} equal chunks")
        out += found
    return out, rejected


def _variants(req: Request, degrees: tuple[int, int, int, int], mb: int,
              m: int) -> list[Layout]:
    tp, cp, pp, dp = degrees
    sp_ok = tp > 1 and not req.config.problems(tp=tp, sp=True, seq=req.seq // cp)  # spec's rule
    sps = [False, True] if sp_ok else [False]
    zeros = list(ZERO_NAMES) if weight_replicas(dp, cp) > 1 else [0]
    # interleaving: 2, 4, 8, ... chunks while they split the layers evenly (one layer a
    # chunk at most), the micro-batches in whole rounds of pp (Megatron's schedule)
    top = (req.config.num_layers + 2) // pp if pp > 1 and m % pp == 0 else 1
    chunks = [1] + [2 ** k for k in range(1, top.bit_length()) if 2 ** k <= top]
    ends = [False] + ([True] if lighter_end_layers(req.config.num_layers, pp) else [])
    reshards = _options(req, "fsdp_reshard", list(FSDP_RESHARD))
    return [Layout(tp, pp, dp, mb, sp, rc, int(z), v, cp, e, r)
            for sp in _options(req, "sp", sps) for rc in _options(req, "recompute", list(RECOMPUTE))
            for z in _options(req, "zero", zeros) for v in _options(req, "interleave", chunks)
            for e in _options(req, "lighter_ends", ends)
            for r in (reshards if int(z) >= 3 else ["after-forward"])
            if chunks_split_evenly(req.config.num_layers, pp, v, e)]


def plan(req: Request, top: int | None = None, distinct: bool = True) -> list[Estimate]:
    """Feasible plans, best first (best of each (tp, pp) when `distinct`), with reasons.

    Raises PlanError when no layout exists or none fits in memory.
    """
    _check_request(req)
    layouts, rejected = candidates(req)
    if not layouts:
        raise PlanError(_no_layout_message(req, rejected))
    c = req.config
    estimates = [evaluate(c, req.seq, req.global_batch, lay, req.cluster, req.precision)
                 for lay in layouts]
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: e.step_time_s)
    if not fitting:
        raise PlanError(_no_fit_message(req, estimates))
    if distinct:
        fitting = best_per_degrees(fitting)
    best = fitting[0]
    for e in fitting:
        e.reason = explain(e, best, c, req.seq, req.cluster)
    return fitting[:top] if top else fitting


def best_per_degrees(ranked: list[Estimate]) -> list[Estimate]:
    """The first (best) plan of each (tp, cp, pp), in order."""
    seen, out = set(), []
    for e in ranked:
        key = (e.layout.tp, e.layout.cp, e.layout.pp)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _check_request(req: Request) -> None:
    cl = req.cluster
    for name, v in (("nodes", cl.nodes), ("devices per node", cl.per_node),
                    ("global batch", req.global_batch), ("sequence length", req.seq)):
        if not isinstance(v, int) or v < 1:
            raise PlanError(f"{name}={v!r} must be a positive integer")


def _no_layout_message(req: Request, rejected: dict[str, str]) -> str:
    c, n = req.config, req.cluster.devices
    why = "; ".join(f"{k}: {v}" for k, v in list(rejected.items())[:6])
    more = f" (and {len(rejected) - 6} more)" if len(rejected) > 6 else ""
    return (f"no (tp, cp, pp, dp) layout of {n} devices works for {c.name} with global batch "
            f"{req.global_batch} and sequence {req.seq}: {why}{more}")


def _no_fit_message(req: Request, estimates: list[Estimate]) -> str:
    smallest = min(estimates, key=lambda e: e.memory["total"])
    lay, acc = smallest.layout, req.cluster.hardware.accelerator
    gb = 1e9
    usable = req.cluster.usable_memory * acc.memory_bytes
    return (f"{req.config.name} ({req.config.num_params() / 1e9:.1f}B parameters) does not fit "
            f"on {req.cluster.devices} x {acc.name}: the smallest plan (tp={lay.tp}, "
            f"cp={lay.cp}, pp={lay.pp}, dp={lay.dp}, micro-batch {lay.micro_batch}, recompute="
            f"{lay.recompute}, dp sharding {ZERO_NAMES[lay.zero]}"
            f"{' after-step' if lay.keeps_gathered_weights else ''}) needs {smallest.memory['total'] / gb:.1f} GB "
            f"per device, {usable / gb:.1f} GB usable of {acc.memory_bytes / gb:.0f} GB; "
            f"add devices or shorten the sequence")
