"""Fitting what `tpkit calibrate` measured into a `local` hardware profile. Pure Python.

    matmul      1/rate = 1/peak + (d_half/peak) (1/d)          (the planner's GEMM model)
    all-reduce  t = 2(p-1) alpha + 2(p-1)/p n / B               (the ring model)
                or, where it fits the samples better, each of the 2(p-1) steps the longer
                of alpha and its chunk's wire time: t = 2(p-1) max(alpha, n/(p B));
                an all-reduce of 8 bytes (a step's loss, its gradient norm) measured
                apart: its time per step is the link's scalar latency

The measuring itself needs torch and processes, so it lives in `tpkit.check.measure`, and the
`tpkit calibrate` command joins the two: `tpkit.plan` imports no torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

from tpkit.plan.cost import all_reduce_time, scalar_all_reduce_time
from tpkit.plan.hardware import GB, Accelerator, Hardware, Link

SCALAR_MAX = 1024  # samples below this many bytes are a step's scalars, not the ring's fit


# -- fits (pure Python) -----------------------------------------------------------------------
def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; returns (a, b)."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n > 1 and sxx else 0.0
    return my - b * mx, b


def fit_gemm(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(peak FLOP/s, d_half) from (smallest side d, FLOP/s) pairs: rate = peak d / (d + d_half)."""
    a, b = linear_fit([1 / d for d, _ in samples], [1 / r for _, r in samples])
    peak = 1 / a if a > 0 else max(r for _, r in samples)
    return peak, max(b * peak, 0.0)


def fit_alpha_beta(samples: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(alpha s, bandwidth B/s) from (p, bytes, seconds): t = 2(p-1) alpha + 2(p-1)/p n/B.

    Least squares on relative errors (each row divided by its t), so that the small
    messages that set alpha count as much as the large ones that set B.
    """
    rows = [(2 * (p - 1) / t, 2 * (p - 1) / p * n / t, 1.0) for p, n, t in samples]
    s11 = sum(u * u for u, _, _ in rows)
    s12 = sum(u * v for u, v, _ in rows)
    s22 = sum(v * v for _, v, _ in rows)
    y1 = sum(u * t for u, _, t in rows)
    y2 = sum(v * t for _, v, t in rows)
    det = s11 * s22 - s12 * s12
    alpha = (y1 * s22 - y2 * s12) / det
    inv_bw = (s11 * y2 - s12 * y1) / det
    return max(alpha, 0.0), 1 / inv_bw if inv_bw > 0 else float("inf")


# -- profile ----------------------------------------------------------------------------------
def build_profile(gemm1: list, mem_bw: float, intra: Link, inter: Link,
                  ram_bytes: float, cores: int, op_overhead: float = 0.0,
                  shared_latency: float = 0.0) -> Hardware:
    """The `local` profile: one device = one process with one thread, one per core;
    `intra` the measured transport between the ranks of this host, `inter` across hosts."""
    peak, d_half = fit_gemm(gemm1)
    acc = Accelerator("local CPU core (measured)", peak, ram_bytes / cores, mem_bw, dtype="fp32",
                      gemm_efficiency=1.0, gemm_half_dim=d_half, op_overhead=op_overhead)
    return Hardware("local", acc, intra, inter, cores, cores, shared_latency)


def fit_overlapped(samples: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(alpha s, bandwidth B/s) from (p, bytes, seconds): each of the 2(p-1) ring steps
    costs max(alpha, n/(p B)), least squares on log times.

    The steps sorted by chunk, the first k latency-bound and the rest wire-bound: for
    each k, alpha is the geometric mean of the first k step times and B that of the
    rest's chunk / time; the k whose max-model fits all steps best wins."""
    steps = sorted((n / p, t / (2 * (p - 1))) for p, n, t in samples)
    best = (math.inf, 0.0, math.inf)
    for k in range(len(steps) + 1):
        alpha = math.exp(_mean([math.log(s) for _, s in steps[:k]])) if k else 0.0
        bw = math.exp(_mean([math.log(c / s) for c, s in steps[k:]])) if k < len(steps) \
            else math.inf
        err = sum(math.log(max(alpha, c / bw) / s) ** 2 for c, s in steps)
        best = min(best, (err, alpha, bw))
    return best[1], best[2]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def log_error(link: Link, samples: list[tuple[int, float, float]]) -> float:
    """Root mean square of log(model / measured) over all-reduce samples (p, bytes, s)."""
    return math.sqrt(_mean([math.log(all_reduce_time(n, p, link) / t) ** 2
                            for p, n, t in samples]))


def fit_link(name: str, samples: list[tuple[int, float, float]]) -> Link:
    """A Link named `name` from all-reduce samples: the ring model with alpha and B added
    (`fit_alpha_beta`) or overlapped (`fit_overlapped`), whichever fits them better (the
    added one on a tie), on the samples of at least 1 KiB; those below (a step's scalars)
    give `Link.scalar_latency`, their mean time per ring step."""
    scalars = [(p, n, t) for p, n, t in samples if n < SCALAR_MAX]
    samples = [(p, n, t) for p, n, t in samples if n >= SCALAR_MAX]
    alpha, bw = fit_alpha_beta(samples)
    added = Link(name, bw, alpha)
    alpha, bw = fit_overlapped(samples)
    overlapped = Link(name, bw, alpha, overlap=True)
    link = min((added, overlapped), key=lambda link: log_error(link, samples))
    if scalars:
        link = replace(link, scalar_latency=_mean([t / (2 * (p - 1)) for p, _, t in scalars]))
    return link


def ram_bytes() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * GB




def matmul_note(one: list, allt: list) -> str:
    """One line: the GEMM fit of one thread and the best rates."""
    peak1, dh1 = fit_gemm(one)
    return (f"matmul 1 thread: fit peak {peak1 / 1e9:.1f} GFLOP/s, d_half {dh1:.0f}; best "
            f"measured {max(r for _, r in one) / 1e9:.1f} GFLOP/s, all threads "
            f"{max(r for _, r in allt) / 1e9:.1f} GFLOP/s")


def link_notes(link: Link, samples: list) -> list[str]:
    """The fit of one link and each sample against it."""
    how = "the longer of the two per step (overlapped)" if link.overlap else "added"
    lines = [f"all-reduce over {link.name}: alpha {link.latency * 1e6:.1f} us, bandwidth "
             f"{link.bandwidth / GB:.2f} GB/s, {how}"]
    if link.scalar_latency is not None:
        lines[0] += f"; {link.scalar_latency * 1e6:.1f} us per step for a few bytes"
    for p, n, t in samples:
        model = all_reduce_time(n, p, link) if n >= SCALAR_MAX else \
            scalar_all_reduce_time(p, link)
        size = f"{n >> 10:>6} KiB" if n >= SCALAR_MAX else f"{n:>6} B  "
        lines.append(f"  p={p} {size}: measured {t * 1e3:8.3f} ms, fit "
                     f"{model * 1e3:8.3f} ms ({model / t - 1:+.0%})")
    return lines
