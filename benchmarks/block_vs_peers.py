"""One Llama-style transformer layer, forward + backward at tp=2 on gloo (one thread per
rank): tpkit against PyTorch DTensor and against Megatron-Core, alternated in one run.

    tpkit          tpkit.model.block.Block: fused qkv (column) -> attention -> out (row) -g->,
                   fused gate/up (column) -> SwiGLU -> down (row) -g->; 2 all-reduces
                   forward, 2 backward
    no ledger      the same model with ledger recording off (its overhead, measured)
    DTensor        a plain Llama block (wq wk wv wo, w1 w2 w3, nn.RMSNorm) with
                   torchtitan's plan: wq/wk/wv/w1/w3 ColwiseParallel, wo/w2
                   RowwiseParallel, on init_device_mesh("cpu", (2,))
    Megatron-Core  the same block from megatron.core.tensor_parallel's
                   ColumnParallelLinear (fused qkv, fused fc1) and RowParallelLinear,
                   local attention; parallel_state.initialize_model_parallel(tp=2),
                   use_cpu_initialization=True

All contenders hold the same weights (those of tpkit's tp=1 model) and are checked
against tp=1 (output and input gradient) before they are timed. Every block takes
x [b, s, h] (Megatron's own models are [s, b, h]; its linear layers do not care).
Times are rank 0's, a barrier before each run, medians over interleaved rounds kept
only while other programs left the 2 cores alone (see common.clean_rounds).

    .venv/bin/python benchmarks/block_vs_peers.py [--quick] [--budget SECONDS]

Writes bench-results/block_vs_peers.json. Without megatron-core installed
(`pip install --no-deps megatron-core`) it compares against DTensor only and says so.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import (
    Contender,
    CpuWatch,
    agree,
    check_agree,
    clean_rounds,
    environment,
    fwd_bwd,
    median_ms,
    parser,
    print_table,
    reps_for,
    spread_ms,
    time_once,
    write_json,
    zero,
)
from tpkit.comm.group import CommGroup
from tpkit.launch import spawn
from tpkit.model.block import Block
from tpkit.spec.config import ModelConfig

TP = 2
OURS, BARE, DTENSOR, MEGATRON = "tpkit", "tpkit no ledger", "DTensor", "Megatron-Core"
TARGETS = dict(compute_vs_fastest_peer=1.0, latency_vs_fastest_peer=1.2)


@dataclass(frozen=True)
class Shape:
    """x [b, s, h]; heads of 64; Llama's ffn (8h/3 rounded up to 256); `regime` labels it."""

    regime: str  # latency, middle or compute
    b: int
    s: int
    h: int
    ffn: int

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def heads(self) -> int:
        return self.h // 64


SHAPES = [
    Shape("latency", 1, 8, 256, 768),
    Shape("latency", 2, 16, 256, 768),
    Shape("latency", 4, 32, 256, 768),
    Shape("middle", 4, 64, 1024, 2816),
    Shape("compute", 4, 256, 1024, 2816),
    Shape("compute", 2, 256, 2048, 5632),
]
QUICK_SHAPES = [SHAPES[0], SHAPES[3], SHAPES[4]]
BUDGET_S = dict(latency=5.0, middle=8.0, compute=20.0)  # seconds of timed rounds per shape


def config_of(shape: Shape) -> ModelConfig:
    """tpkit's config for this shape: Llama-style, no bias, no GQA, no dropout."""
    return ModelConfig(hidden=shape.h, num_heads=shape.heads, kv_heads=shape.heads,
                       ffn=shape.ffn, num_layers=1, norm="rmsnorm", activation="swiglu",
                       position="rope", bias=False, max_seq_len=shape.s)


# -- the peers' block: plain Llama, as torchtitan writes it (rotate-half RoPE) -------------
def rope_table(s: int, hd: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [s, hd], computed once per model (torchtitan's precomputed freqs_cis)."""
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # [hd/2]
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)  # [s, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [s, hd]
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, hd] rotated by position (Llama's rotate-half layout)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hd: int, cos, sin) -> torch.Tensor:
    """[b, s, heads*hd] each (this rank's heads) -> causal attention [b, s, heads*hd]."""
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))  # [b, nh/tp, s, hd]
    y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                       is_causal=True)  # [b, nh/tp, s, hd]
    return y.transpose(1, 2).reshape(b, s, -1)  # [b, s, h/tp]


class LlamaBlock(nn.Module):
    """x + attention(norm(x)), then + w2(silu(w1 n) * w3 n); heads inferred from the
    local width (`view(b, s, -1, hd)`), so DTensor's sharded projections just work."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        h, f, hd = c.hidden, c.ffn, c.head_dim
        self.hd = hd
        self.attention_norm = nn.RMSNorm(h, eps=c.norm_eps)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.ffn_norm = nn.RMSNorm(h, eps=c.norm_eps)
        self.w1, self.w3 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)
        cos, sin = rope_table(c.max_seq_len, hd, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        n = self.attention_norm(x)  # [b, s, h]
        a = attend(self.wq(n), self.wk(n), self.wv(n), self.hd, self.cos[:s], self.sin[:s])
        x = x + self.wo(a)  # [b, s, h]
        n = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(n)) * self.w3(n))  # [b, s, h]


def load_llama(m: LlamaBlock, ref: Block) -> LlamaBlock:
    """Copy tpkit's tp=1 weights: qkv rows [q; k; v], fc1 rows [gate; up]."""
    h, f = m.wq.in_features, m.w1.out_features
    with torch.no_grad():
        q, k, v = ref.attn.qkv.weight.split([h, h, h])
        gate, up = ref.mlp.fc1.weight.split([f, f])
        for lin, w in ((m.wq, q), (m.wk, k), (m.wv, v), (m.wo, ref.attn.out.weight),
                       (m.w1, gate), (m.w3, up), (m.w2, ref.mlp.fc2.weight)):
            lin.weight.copy_(w)
        m.attention_norm.weight.copy_(ref.attn_norm.weight)
        m.ffn_norm.weight.copy_(ref.mlp_norm.weight)
    return m


def dtensor_block(ref: Block, c: ModelConfig, device_mesh) -> nn.Module:
    """torchtitan's Llama tensor-parallel plan (no sequence parallelism) on LlamaBlock."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    col, row = ColwiseParallel(), RowwiseParallel()
    plan = dict(wq=col, wk=col, wv=col, wo=row, w1=col, w3=col, w2=row)
    return parallelize_module(load_llama(LlamaBlock(c), ref), device_mesh, plan)


class MegatronBlock(nn.Module):
    """LlamaBlock from Megatron-Core's layers: linear_qkv and linear_fc1 fused column-
    parallel (each rank [q_r; k_r; v_r] and [gate_r; up_r]), linear_proj and linear_fc2
    row-parallel; its backward all-reduce overlaps the weight-gradient GEMM (async)."""

    def __init__(self, c: ModelConfig, ours: Block) -> None:
        from megatron.core import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        h, f, self.hd = c.hidden, c.ffn, c.head_dim
        mc = ModelParallelConfig(tensor_model_parallel_size=TP, use_cpu_initialization=True,
                                 perform_initialization=False, params_dtype=torch.float32)
        kw = dict(config=mc, init_method=nn.init.zeros_, bias=False)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(h, eps=c.norm_eps), nn.RMSNorm(h, eps=c.norm_eps)
        self.linear_qkv = ColumnParallelLinear(h, 3 * h, gather_output=False, **kw)
        self.linear_proj = RowParallelLinear(h, h, input_is_parallel=True, skip_bias_add=False, **kw)
        self.linear_fc1 = ColumnParallelLinear(h, 2 * f, gather_output=False, **kw)
        self.linear_fc2 = RowParallelLinear(f, h, input_is_parallel=True, skip_bias_add=False, **kw)
        cos, sin = rope_table(c.max_seq_len, self.hd, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        with torch.no_grad():  # tpkit's tp=2 shards have exactly Megatron's local layout
            for mine, theirs in ((self.linear_qkv, ours.attn.qkv), (self.linear_proj, ours.attn.out),
                                 (self.linear_fc1, ours.mlp.fc1), (self.linear_fc2, ours.mlp.fc2)):
                mine.weight.copy_(theirs.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        qkv, _ = self.linear_qkv(self.attention_norm(x))  # [b, s, 3h/tp]
        a = attend(*qkv.chunk(3, dim=-1), self.hd, self.cos[:s], self.sin[:s])  # [b, s, h/tp]
        x = x + self.linear_proj(a)[0]  # [b, s, h]
        gate, up = self.linear_fc1(self.ffn_norm(x))[0].chunk(2, dim=-1)  # [b, s, f/tp] each
        return x + self.linear_fc2(F.silu(gate) * up)[0]  # [b, s, h]


def megatron_ready() -> str | None:
    """Initialize Megatron-Core's tensor-parallel state once; None, or why it cannot run."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state
    except ImportError as e:
        return f"megatron-core is not importable: {e}"
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    return None


# -- timing --------------------------------------------------------------------------------
def contenders(mesh, shape: Shape, device_mesh, keep: dict, cpu: dict, with_megatron: bool
               ) -> tuple[list[Contender], Block, torch.Tensor, torch.Tensor]:
    """The ways of running this shape (identical weights and inputs); tp=1, x and dL/dy."""
    c = config_of(shape)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape.b, shape.s, shape.h, generator=gen).requires_grad_()  # [b, s, h]
    g = torch.randn(shape.b, shape.s, shape.h, generator=gen)  # [b, s, h], dL/dy
    ours = Block(c, mesh.tp_group, layer_index=0, seed=0)
    bare = Block(c, mesh.tp_group, layer_index=0, seed=0)  # own copy: no cache warmed by ours
    single = Block(c, CommGroup.single(), layer_index=0, seed=0)
    peer = dtensor_block(single, c, device_mesh)
    led = mesh.ledger
    cs = [Contender(OURS, fwd_bwd(ours, x, g, keep, OURS, cpu), zero(ours, x, led, True)),
          Contender(BARE, fwd_bwd(bare, x, g, keep, BARE, cpu), zero(bare, x, led, False)),
          Contender(DTENSOR, fwd_bwd(peer, x, g, keep, DTENSOR, cpu), zero(peer, x))]
    if with_megatron:
        meg = MegatronBlock(c, ours)
        cs.append(Contender(MEGATRON, fwd_bwd(meg, x, g, keep, MEGATRON, cpu), zero(meg, x)))
    return cs, single, x, g


def check_block(keep: dict, single: Block, x: torch.Tensor, g: torch.Tensor, shape: Shape
                ) -> None:
    """Every contender gave tp=1's output and input gradient (checked on rank 0)."""
    x1 = x.detach().clone().requires_grad_()
    y1 = single(x1)
    y1.backward(g)
    check_agree(keep, y1, x1.grad, shape)


def bench_shape(mesh, shape: Shape, device_mesh, budget_s: float, with_megatron: bool,
                watch: CpuWatch | None) -> dict | None:
    """Warm up, check against tp=1, then time all contenders in clean interleaved rounds."""
    keep: dict = {}
    cpu: dict = {}
    cs, single, x, g = contenders(mesh, shape, device_mesh, keep, cpu, with_megatron)
    for _ in range(2):  # the second warm-up round sizes the run
        warm = [time_once(c, dist.barrier) for c in cs]
    if mesh.rank == 0:
        check_block(keep, single, x, g, shape)
    cpu.clear()
    round_s = agree(sum(warm))
    reps = reps_for(round_s, budget_s, lo=5)
    t0 = time.perf_counter()
    times, facts = clean_rounds(cs, reps, round_s, dist.barrier, agree, watch,
                                max_s=1.5 * budget_s)
    mesh.ledger.enabled = True
    if mesh.rank != 0:
        return None
    return dict(shape=asdict(shape), tokens=shape.tokens, heads=shape.heads, rounds=facts,
                wall_s=time.perf_counter() - t0,
                median_ms={k: median_ms(v) for k, v in times.items()},
                cpu_ms={k: median_ms(v) for k, v in cpu.items()},
                iqr_ms={k: spread_ms(v) for k, v in times.items()})


def run_all(mesh, shapes: list[Shape], budgets: dict[str, float]) -> tuple | None:
    """On every rank: all shapes in turn; rank 0 returns (rows, why Megatron is absent)."""
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (TP,))
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")  # GPU advice
    why_not = megatron_ready()
    pids = [None] * TP
    dist.all_gather_object(pids, os.getpid())
    watch = CpuWatch(pids) if mesh.rank == 0 else None
    rows = [bench_shape(mesh, s, device_mesh, budgets[s.regime], why_not is None, watch)
            for s in shapes]
    return (rows, why_not) if mesh.rank == 0 else None


# -- report --------------------------------------------------------------------------------
def add_ratios(row: dict) -> dict:
    """Speed-ups of tpkit (higher is better for tpkit) and the ledger's cost."""
    m = row["median_ms"]
    peers = {k: v for k, v in m.items() if k in (DTENSOR, MEGATRON)}
    fastest = min(peers, key=peers.get)
    row["fastest_peer"] = fastest
    row["ratios"] = {f"vs {k}": v / m[OURS] for k, v in peers.items()}
    row["ratios"]["vs fastest peer"] = peers[fastest] / m[OURS]
    row["ratios"]["no ledger vs fastest peer"] = peers[fastest] / m[BARE]
    row["ledger_overhead_ms"] = m[OURS] - m[BARE]
    return row


def verdicts(rows: list[dict]) -> dict:
    """Each target, judged on the worst row of its regime."""
    out = {}
    for regime in ("compute", "latency"):
        rs = [r["ratios"]["vs fastest peer"] for r in rows if r["shape"]["regime"] == regime]
        target = TARGETS[f"{regime}_vs_fastest_peer"]
        worst = min(rs, default=None)
        out[f"{regime}_vs_fastest_peer"] = dict(target=target, worst=worst,
                                                met=worst is not None and worst >= target)
    return out


def report(rows: list[dict], verdict: dict, why_not: str | None) -> None:
    """The table of medians and ratios, then the verdict on each target."""
    names = [OURS, BARE, DTENSOR] + ([] if why_not else [MEGATRON])
    cols = ["regime", "b x s", "h / ffn / heads", "rounds", *(f"{n} ms" for n in names),
            "vs DTensor", *([] if why_not else ["vs Megatron"]), "ledger ms", "others' CPU"]
    table = []
    for r in rows:
        s, m, q, f = r["shape"], r["median_ms"], r["ratios"], r["rounds"]
        table.append([s["regime"], f"{s['b']}x{s['s']}={r['tokens']}",
                      f"{s['h']}/{s['ffn']}/{r['heads']}", f"{f['clean_rounds']}/{f['all_rounds']}",
                      *(f"{m[n]:.3f}" for n in names), f"{q['vs ' + DTENSOR]:.2f}x",
                      *([] if why_not else [f"{q['vs ' + MEGATRON]:.2f}x"]),
                      f"{r['ledger_overhead_ms']:+.3f}",
                      f"{f['others_cores_median']:.2f}"])
    print_table("One Llama layer forward+backward, tp=2, gloo, 1 thread per rank (medians; "
                "ratios: peer / tpkit, higher = tpkit faster)", cols, table)
    print_table("The same runs, CPU ms of rank 0's main thread (work, waiting excluded; all "
                "rounds)", ["regime", "b x s", *names],
                [[r["shape"]["regime"], f"{r['shape']['b']}x{r['shape']['s']}",
                  *(f"{r['cpu_ms'][n]:.3f}" for n in names)] for r in rows])
    print("  rounds: clean / all (a round counts if other programs used < 0.05 core while it "
          "ran); others' CPU: cores, median over blocks")
    if why_not:
        print(f"  Megatron-Core left out: {why_not}")
    for name, v in verdict.items():
        worst = "n/a" if v["worst"] is None else f"{v['worst']:.2f}x"
        print(f"  {name:<26} target >= {v['target']:.1f}x  worst {worst:>6}  "
              f"{'MET' if v['met'] else 'MISSED'}")


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    budgets = {k: (args.budget or v) / (4 if args.quick and args.budget is None else 1)
               for k, v in BUDGET_S.items()}
    t0 = time.perf_counter()
    rows, why_not = spawn(run_all, TP, shapes, budgets, mesh=dict(tp=TP), threads=1,
                          timeout=1200)[0]
    rows = [add_ratios(r) for r in rows]
    verdict = verdicts(rows)
    report(rows, verdict, why_not)
    path = write_json("block_vs_peers", dict(
        benchmark="block_vs_peers", quick=args.quick, tp=TP, backend="gloo", threads_per_rank=1,
        block="llama: rmsnorm, rope, swiglu, no bias, no GQA, causal, float32",
        megatron=why_not or "megatron-core " + _version("megatron-core"),
        timing="rank 0, median over interleaved clean rounds, barrier before each",
        targets=TARGETS, verdict=verdict, env=environment(),
        total_wall_s=time.perf_counter() - t0, results=rows))
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


def _version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "absent"


if __name__ == "__main__":
    raise SystemExit(main())
