"""What `--compile` buys on CPU: one whole training step (forward, backward, AdamW) of
the same GPT, eager blocks against compiled ones (Inductor), alternated round by round
in one run, after checking that both compute the same loss and gradients.

    PYTHONPATH=src .venv/bin/python benchmarks/compile_speedup.py [--tp 2] [--hidden 256]

Prints the compile time (the first compiled step minus an eager one) and the ratio of
median step times. One thread per rank; on a busy machine the rounds during which
other programs ran are kept anyway and the figure says so.
"""

from __future__ import annotations

import time

import torch

from common import Contender, environment, parser, print_table, round_robin, write_json
from tpkit.launch import spawn
from tpkit.model import Transformer
from tpkit.spec import get_preset
from tpkit.train.compile import compiled_graphs


def model_config(a):
    return get_preset("gpt2-tiny").with_(
        name="gpt2-bench", hidden=a.hidden, num_layers=a.layers, num_heads=a.hidden // 64,
        max_seq_len=a.seq, vocab_size=a.vocab, dropout=0.0)


def fwd_bwd(model, ids) -> float:
    model.zero_grad(set_to_none=True)
    loss = model.loss(model(ids), ids.roll(-1, 1))
    loss.backward()
    model.finalize_grads()
    return loss.item()


def worker(mesh, a) -> dict:
    import torch.distributed as dist

    cfg = model_config(a)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq),
                        generator=torch.Generator().manual_seed(0))
    models = {n: Transformer(cfg, mesh, seed=1, loss_chunk=a.loss_chunk,
                             compile_backend=a.backend if n == "compiled" else None)
              for n in ("eager", "compiled")}
    first = {}
    for name, m in models.items():  # the check (and, compiled, the compilation)
        t0 = time.perf_counter()
        first[name] = (fwd_bwd(m, ids), time.perf_counter() - t0,
                       {k: p.grad.clone() for k, p in m.named_parameters()})
    (le, te, ge), (lc, tc, gc) = first["eager"], first["compiled"]
    diff = max([abs(le - lc)] + [(ge[k] - gc[k]).abs().max().item() for k in ge])
    if diff > a.tol:
        raise AssertionError(f"compiled blocks differ from eager by {diff:.2e} (tol {a.tol})")
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}

    def step(name):
        def run():
            fwd_bwd(models[name], ids)
            opts[name].step()
        return run

    graphs = compiled_graphs()
    sync = (lambda: dist.barrier()) if mesh.world_size > 1 else (lambda: None)
    times = round_robin([Contender(n, step(n)) for n in models], a.reps, sync, warmup=2)
    return dict(times=times, diff=diff, compile_s=tc - te, graphs=graphs,
                recompiled=compiled_graphs() - graphs)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--loss-chunk", type=int, default=0, help="chunked loss (compiled too)")
    p.add_argument("--tol", type=float, default=1e-5)
    a = p.parse_args()
    if a.quick:
        a.reps = 3
    if a.tp == 1:
        from tpkit.mesh import ParallelMesh

        torch.set_num_threads(1)
        r = worker(ParallelMesh.single(), a)
    else:
        r = spawn(worker, a.tp, a, mesh=dict(tp=a.tp), threads=1, timeout=3600.0)[0]
    import statistics

    med = {n: statistics.median(ts) for n, ts in r["times"].items()}
    print_table(f"one training step at tp={a.tp}: h={a.hidden}, {a.layers} layers, b={a.batch}, "
                f"s={a.seq}, vocab {a.vocab}, loss chunk {a.loss_chunk or 'off'}, fp32, "
                f"{a.reps} alternated rounds",
                ["blocks", "median ms", "speed-up"],
                [[n, f"{1e3 * m:.1f}", f"{med['eager'] / m:.2f}x"] for n, m in med.items()])
    print(f"compile ({a.backend}): {r['compile_s']:.1f} s; {r['graphs']} graphs, "
          f"{r['recompiled']} more while timing; max |diff| vs eager {r['diff']:.1e}")
    write_json(f"compile_speedup_tp{a.tp}", dict(environment=environment(), args=vars(a),
                                                 median_s=med, **{k: r[k] for k in (
                                                     "diff", "compile_s", "graphs",
                                                     "recompiled")}))


if __name__ == "__main__":
    main()
