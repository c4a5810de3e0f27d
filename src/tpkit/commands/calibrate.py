"""`tpkit calibrate`: measure this machine into a hardware profile called `local`.

    matmul      float32, the 3 GEMMs of a linear layer of smallest side d = 16..1024, one
                thread, then all threads;
                fit  1/rate = 1/peak + (d_half/peak) (1/d)   (the planner's GEMM model)
    elementwise a layer's mix at activation size (layer norm, tanh-GELU on the 4h MLP
                activation, residual add): the bytes/s elementwise kernels get
    dispatch    a chain of tiny multiplies, forward + backward: seconds per dispatched op
    all-reduce  p = 2 and 4 local processes (at most one per core), 4 KiB .. 16 MiB,
                twice: over the transport `tpkit train` uses between the ranks of one
                host (shared memory, `--comm auto`; gloo where its kernels are missing)
                -> the profile's intra link, and over gloo (TCP, what groups across
                hosts use; on one machine, over loopback) -> its inter link;
                least squares fit of t = 2(p-1) alpha + 2(p-1)/p n / B (the ring model),
                or of t = 2(p-1) max(alpha, n/(p B)) where that fits better (a step's
                bytes travel while its peer is still being woken: gloo between hosts);
                then 2 x cores processes in pairs: the latency of a step when processes
                outnumber cores and a peer must first be scheduled

A "device" of the local profile is one process with one thread (how `tpkit.launch` runs
tests with `threads=1`). The profile goes to --out, by default ~/.cache/tpkit/local.toml ($TPKIT_CACHE): the
path is printed before anything is measured, and a file there that `tpkit calibrate` did
not write is refused, not overwritten. `tpkit plan --hardware local` reads it. The
measuring is `tpkit.check.measure` (torch, local processes); the fits are pure Python
(`tpkit.plan.fit`).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

from tpkit.check.measure import (
    measure_across,
    measure_all_reduce,
    measure_matmul,
    measure_memory_bandwidth,
    measure_op_overhead,
    measure_shared_latency,
)
from tpkit.commands.common import deprecated_alias
from tpkit.plan.fit import build_profile, fit_link, link_notes, matmul_note, ram_bytes
from tpkit.plan.hardware import GB, default_local_path, load_profiles, profile_to_toml
from tpkit.spec.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `tpkit calibrate`."""
    p.add_argument("--out", help=f"profile file (default {default_local_path()})")
    processes = p.add_argument("--processes", type=int, default=2,
                               help="processes for the all-reduce fit (4 as well, up to the "
                                    "cores)")
    deprecated_alias(p, processes, "--nproc")
    p.add_argument("--reps", type=int, default=30, help="timed all-reduces per size")
    p.add_argument("--across", action="store_true",
                   help="under torchrun on every host: time gloo between the hosts and "
                        "write it as the inter link of the profile at --out (made by a plain "
                        "`tpkit calibrate` first); with --nproc_per_node as the run's, both "
                        "links as the run loads them")


HEADER = "# tpkit calibrate"


def run(args: argparse.Namespace) -> int:
    """Measure, fit, write the profile, print what was found and where it went."""
    out = Path(args.out) if args.out else default_local_path()
    refuse_foreign(out)
    if args.across:
        return run_across(out, args)
    print(f"tpkit calibrate: measuring this machine into {out}", flush=True)
    cores = os.cpu_count() or 1
    print(f"matmul, float32, 1 thread and {cores} threads ...", flush=True)
    one, allt = measure_matmul(1), measure_matmul(cores)
    mem_bw, op_s = measure_memory_bandwidth(), measure_op_overhead()
    links = [measure_link(comm, args, cores) for comm in (None, "gloo")]
    shared = measure_shared_latency(cores, args.reps)
    hw = build_profile(one, mem_bw, links[0][0], links[1][0], ram_bytes(), cores, op_s, shared)
    lines = [matmul_note(one, allt), *link_notes(*links[0]), *link_notes(*links[1]),
             f"elementwise {mem_bw / GB:.2f} GB/s, dispatch {op_s * 1e6:.2f} us per op, "
             f"all-reduce step with {2 * cores} processes on {cores} cores {shared * 1e6:.0f} us"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"{HEADER}, {time.strftime('%Y-%m-%d %H:%M')}, {cores} cores\n"
                   + "".join(f"# {line}\n" for line in lines) + profile_to_toml(hw))
    print("\n".join(lines) + f"\nwrote {out}; use `tpkit plan --hardware local"
          + ("" if out == default_local_path() else f" --hardware-file {out}") + "`")
    return 0


def measure_link(comm: str | None, args: argparse.Namespace, cores: int):
    """(Link, samples): all-reduces on 2 (and 4) local processes over `comm` (None: what
    a run picks inside a host), fitted; named by the transport that carried them."""
    samples, transport = [], "gloo"
    for p in sorted({p for p in (args.processes, 4) if p <= max(cores, 2)}):
        print(f"all-reduce on {p} processes, {comm or 'the transport inside a host'} ...",
              flush=True)
        transport, got = measure_all_reduce(p, reps=args.reps, comm=comm)
        samples += got
    name = f"{transport} (measured)" if comm is None else "gloo over loopback (measured)"
    return fit_link(name, samples), samples


def refuse_foreign(out: Path) -> None:
    """One line, and nothing written, where `out` exists and is not a calibrate profile."""
    try:
        first = out.read_text(errors="replace").split("\n", 1)[0] if out.exists() else HEADER
    except OSError as e:
        raise UserError(f"--out {out}: cannot read it ({e.strerror})") from None
    if out.is_dir() or not first.startswith(HEADER):
        raise UserError(f"--out {out} exists and was not written by `tpkit calibrate`; "
                        f"remove it or give another --out")


def run_across(out: Path, args: argparse.Namespace) -> int:
    """The links of a run over hosts into the profile (rank 0 writes, every rank
    measures). Hosts that are one machine (`tpkit cluster`) share its cores: the profile
    then counts a host's share of them. With P processes per host (torchrun
    --nproc_per_node P, as the run will have), both transports are measured as the run
    loads them, P groups at once: the inter link per group on a shared port (one port
    per device in the profile: the sharing is in the figure) and the intra link with
    the cores shared (its latency is the profile's shared latency: no wait on top)."""
    if not out.exists():
        raise UserError(f"--across updates the profile at {out}: run `tpkit calibrate --out "
                        f"{out}` on one host first")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or "LOCAL_WORLD_SIZE" not in os.environ:
        raise UserError("--across runs under torchrun on two or more hosts (--nproc_per_node "
                        "1, or as many as the run will have per host)")
    found = measure_across(reps=args.reps)
    if os.environ.get("RANK") != "0":
        return 0
    per_host, hosts = found["per_host"], len(found["hosts"])
    link = fit_link(f"{found['transport']} across hosts (measured, {per_host} per host)",
                    found["samples"])
    hw = load_profiles(out)["local"]
    cores = hw.cores_per_node // hosts if found["machines"] == 1 else hw.cores_per_node
    hw = replace(hw, inter=link, nics_per_node=per_host, cores_per_node=max(cores, 1),
                 devices_per_node=max(cores, per_host, 1))
    lines = link_notes(link, found["samples"])
    if found["inside"]:
        transport, samples = found["inside"]
        intra = fit_link(f"{transport} inside a host (measured, {per_host} per host)", samples)
        hw = replace(hw, intra=intra, shared_latency=intra.latency)
        lines += link_notes(intra, samples)
    lines.append(f"hosts {', '.join(found['hosts'])} on {found['machines']} machine(s): "
                 f"{hw.cores_per_node} cores and one port per host, {per_host} process(es) "
                 f"per host")
    kept = [ln for ln in out.read_text().splitlines() if ln.startswith("#")]
    out.write_text("\n".join(kept) + "\n" + "".join(f"# {ln}\n" for ln in lines)
                   + profile_to_toml(hw))
    print("\n".join(lines) + f"\nwrote the links across hosts into {out}")
    return 0
