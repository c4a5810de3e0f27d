"""What tpkit adds around each collective, measured in one process with a transport that
does nothing (torch.distributed.all_reduce replaced by a no-op: no peer, no wait, no
load of the other rank can blur microseconds).

    no-op transport     the transport call alone
    all_reduce          tpkit.comm.all_reduce: graph-break wrapper + failure guard +
                        ledger record, ledger on and off
    undecorated         the same without the graph-break wrapper
    guard only          `_guarded` around nothing
    MLP step            the Megatron MLP forward + backward at the latency shape of
                        mlp_vs_peers.py (1 x 8 tokens, h=256, ffn=1024 over 2 "ranks"),
                        ledger on and off: the ledger's cost per step

Each figure is the best of 60 short timed loops (the least disturbed by other programs).

    .venv/bin/python benchmarks/ledger_overhead.py
    PYTHONPATH=<an older checkout>/src ...     # the same figures for older code

Writes bench-results/ledger_overhead.json.
"""

from __future__ import annotations

import time

import torch

from common import environment, parser, print_table, write_json
from tpkit.comm import collectives as C
from tpkit.comm.group import CommGroup
from tpkit.comm.ledger import Ledger
from tpkit.layers import ParallelMLP


class Done:
    """The handle of a collective that did nothing."""

    def wait(self) -> bool:
        return True


def best_us(f, reps: int, loops: int = 60) -> float:
    """Microseconds per call of `f`, best loop of `loops`."""
    for _ in range(reps // 10 + 1):
        f()
    best = float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def measure() -> dict[str, float]:
    torch.set_num_threads(1)
    C.dist.all_reduce = lambda *args, **kwargs: Done()  # this process sends nothing
    led = Ledger()
    g = CommGroup("tp", (0, 1), 0, pg=object(), ledger=led)
    x = torch.ones(8 * 256)  # [1, 8, 256]
    raw = C.all_reduce.__wrapped__

    def on(f):
        def run():
            f()
            led.records.clear()
        return run

    def guard_only():
        with C._guarded("all_reduce", g, 1, 4, "forward", None):
            pass

    out = {"no-op transport": best_us(lambda: C.dist.all_reduce(x, group=g.pg), 2000)}
    for name, f in (("all_reduce", lambda: C.all_reduce(x, g)),
                    ("undecorated", lambda: raw(x, g)), ("guard only", guard_only)):
        led.enabled = True
        out[f"{name}, ledger on"] = best_us(on(f), 2000)
        led.enabled = False
        out[f"{name}, ledger off"] = best_us(f, 2000)
    mlp = ParallelMLP(256, 1024, g, activation="gelu", seed=0)
    xs = torch.randn(1, 8, 256, requires_grad=True)  # [b, s, h]
    gy = torch.randn(1, 8, 256)

    def step():
        mlp.zero_grad(set_to_none=True)
        xs.grad = None
        mlp(xs).backward(gy)

    for _ in range(2):  # alternated: drift hits both
        for enabled in (True, False):
            led.enabled = enabled
            key = f"MLP step, ledger {'on' if enabled else 'off'}"
            out[key] = min(out.get(key, float("inf")), best_us(on(step), 10))
    return out


def main() -> None:
    parser(__doc__.split("\n\n")[0]).parse_args()
    load = open("/proc/loadavg").read().split()[:3]
    out = measure()
    print_table(f"per call, us (best loop; load {' '.join(load)})", ["what", "us"],
                [[k, f"{v:.2f}"] for k, v in out.items()])
    step = out["MLP step, ledger on"] - out["MLP step, ledger off"]
    print(f"  the ledger's cost per MLP step: {step:+.1f} us (target <= 100 us)")
    write_json("ledger_overhead", dict(environment=environment(), load=load, us=out,
                                       ledger_per_step_us=step))


if __name__ == "__main__":
    main()
