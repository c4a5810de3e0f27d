"""Hardware profiles: accelerators, links inside a node, links between nodes. Pure Python.

A profile is what the cost model needs to turn FLOPs and bytes into seconds:

    accelerator  peak dense FLOP/s (training dtype), memory, memory bandwidth,
                 the fraction of peak a large GEMM reaches, dispatch time per op
    intra link   bus bandwidth and per-step latency of collectives inside a node
    inter link   the same between nodes (per device: each GPU has its own NIC on DGX/HGX)
    cores        CPU processes share the host's cores: more devices than cores time-share

Every figure carries its public source. "Achievable" bandwidths are the bus bandwidths
that NCCL's `all_reduce_perf` reports for large messages (nccl-tests README defines
busbw); they sit at 75-90% of the link's nominal one-direction rate. Users add their own
profiles in a TOML file (`--hardware-file`, format in `profile_to_toml`), and
`tpkit calibrate` writes one called `local` for this machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from tpkit.spec.errors import UserError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

GB = 1e9
MIB = 2**20  # GPU memory is sized in binary units: an "80 GB" card holds 80 GiB
TFLOPS = 1e12


@dataclass(frozen=True)
class Accelerator:
    """One device: peak dense FLOP/s in its training dtype, memory and its bandwidth."""

    name: str
    peak_flops: float  # dense FLOP/s in `dtype` (no sparsity)
    memory_bytes: float
    mem_bandwidth: float  # bytes/s, HBM (or DRAM)
    dtype: str = "bf16"
    gemm_efficiency: float = 0.8  # fraction of peak that a large GEMM reaches
    gemm_half_dim: float = 64.0  # a GEMM whose smallest side is d reaches d/(d+this) of that
    op_overhead: float = 0.0  # seconds of framework dispatch per op (eager CPU: a few us)


@dataclass(frozen=True)
class Link:
    """A link as a collective sees it: bus bandwidth per device and latency per step."""

    name: str
    bandwidth: float  # bytes/s, achievable bus bandwidth per device
    latency: float  # seconds per ring step (alpha)
    overlap: bool = False  # a step costs max(alpha, wire time), not their sum (`cost.step_time`)
    scalar_latency: float | None = None  # seconds per ring step of an all-reduce of a few
    # bytes (a step's loss and gradient norm), measured at that size; None: `latency`


@dataclass(frozen=True)
class Hardware:
    """A cluster building block: accelerators, devices per node, and the two links."""

    name: str
    accelerator: Accelerator
    intra: Link
    inter: Link
    devices_per_node: int = 8
    cores_per_node: int = 0  # compute units the devices share (CPU cores); 0: one per device
    shared_latency: float = 0.0  # collective latency per step when devices > cores (0: alpha)
    nics_per_node: int = 0  # network ports a node's devices share; 0: one per device (DGX/HGX)


# -- accelerators ------------------------------------------------------------------------
ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TFLOP/s dense; HBM2 40 GB at
    # 1,555 GB/s, HBM2e 80 GB at 2,039 GB/s (SXM). gemm_efficiency 0.70 (~220 TFLOP/s in
    # Megatron's GEMMs) is the one fitted figure: chosen against Narayanan et al. 2021
    # table 1 (docs/planner.md lists the errors it leaves); cuBLAS alone gets ~0.8.
    # Memory as nvidia-smi's memory.total reports it (40,960 and 81,920 MiB): the
    # datasheet's "40 GB" and "80 GB" are binary, 42.9 and 85.9 GB.
    "a100-40gb": Accelerator("A100-SXM4-40GB", 312 * TFLOPS, 40960 * MIB, 1555 * GB,
                             gemm_efficiency=0.70),
    "a100-80gb": Accelerator("A100-SXM4-80GB", 312 * TFLOPS, 81920 * MIB, 2039 * GB,
                             gemm_efficiency=0.70),
    # NVIDIA H100 Tensor Core GPU datasheet: H100 SXM BF16 989 TFLOP/s dense (1,979 with
    # sparsity), 80 GB HBM3 at 3.35 TB/s. gemm_efficiency 0.65 is an assumption (no
    # published layout sweep to fit it); Dubey et al. 2024 (Llama 3) report 38-43% MFU
    # end to end on H100, which this leaves room for. nvidia-smi reports 81,559 MiB
    # (85.5 GB) of memory.total for the "80 GB".
    "h100": Accelerator("H100-SXM5-80GB", 989 * TFLOPS, 81559 * MIB, 3350 * GB,
                        gemm_efficiency=0.65),
    # NVIDIA H200 datasheet: same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s;
    # nvidia-smi reports 143,771 MiB (150.8 GB).
    "h200": Accelerator("H200-SXM-141GB", 989 * TFLOPS, 143771 * MIB, 4800 * GB,
                        gemm_efficiency=0.65),
    # NVIDIA DGX B200 datasheet: 1,440 GB HBM3e over 8 GPUs (180 GB each), 64 TB/s (8 TB/s
    # each); HGX B200 spec: BF16 2.25 PFLOP/s dense (4.5 with sparsity). Efficiency as H100.
    "b200": Accelerator("B200-180GB", 2250 * TFLOPS, 180 * GB, 8000 * GB, gemm_efficiency=0.65),
    # NVIDIA V100 datasheet: 125 TFLOP/s FP16 tensor, 32 GB HBM2 at 900 GB/s. DGX-2H runs
    # them at 450 W: Shoeybi et al. 2019 quote 39 TFLOP/s as 30% of peak, i.e. 130 TFLOP/s.
    # "32 GB" is 32,768 MiB.
    "v100-dgx2h": Accelerator("V100-SXM3-32GB", 130 * TFLOPS, 32768 * MIB, 900 * GB,
                              dtype="fp16"),
    # A nominal CPU socket: 16 cores x 2 AVX2 FMA units x 8 fp32 lanes x 2 FLOP x 3 GHz
    # = 1.5 TFLOP/s fp32; DDR4-3200 x 4 channels = 102 GB/s nominal. Replace it with a
    # measured profile (`tpkit calibrate`).
    "cpu": Accelerator("CPU (nominal 16 cores)", 1.5 * TFLOPS, 64 * GB, 102 * GB, dtype="fp32",
                       gemm_efficiency=0.6),
}

# -- links ---------------------------------------------------------------------------------
LINKS: dict[str, Link] = {
    # NVLink 3 (A100 datasheet: 600 GB/s total, i.e. 300 GB/s per direction); nccl-tests
    # all_reduce busbw on DGX A100 is ~230 GB/s for large messages.
    "nvlink3": Link("NVLink 3", 230 * GB, 2e-6),
    # NVLink 4 (H100 datasheet: 900 GB/s total, 450 per direction); nccl-tests busbw on
    # DGX H100 is ~360 GB/s without NVLink SHARP.
    "nvlink4": Link("NVLink 4", 360 * GB, 2e-6),
    # NVLink 5 (B200: 1.8 TB/s total, 900 per direction); ~80% of it assumed achievable.
    "nvlink5": Link("NVLink 5", 720 * GB, 2e-6),
    # NVSwitch in DGX-2H (Shoeybi et al. 2019: "300 GB/sec bandwidth between GPUs inside a
    # server", i.e. 150 per direction); ~80% assumed achievable.
    "nvswitch-v100": Link("NVSwitch (DGX-2H)", 120 * GB, 3e-6),
    # PCIe Gen4 x16: 31.5 GB/s per direction (PCI-SIG); ~70% achievable through the host.
    "pcie4": Link("PCIe Gen4 x16", 22 * GB, 5e-6),
    # PCIe Gen5 x16: 63 GB/s per direction (PCI-SIG); ~70% achievable.
    "pcie5": Link("PCIe Gen5 x16", 44 * GB, 5e-6),
    # InfiniBand HDR 200 Gb/s = 25 GB/s, one HCA per GPU on DGX A100 (DGX A100 user guide);
    # multi-node nccl-tests reach ~23 GB/s busbw per GPU.
    "ib-hdr": Link("InfiniBand HDR", 23 * GB, 6e-6),
    # InfiniBand NDR 400 Gb/s = 50 GB/s, one ConnectX-7 per GPU on DGX H100 (datasheet);
    # ~90% achievable.
    "ib-ndr": Link("InfiniBand NDR", 45 * GB, 6e-6),
    # Shoeybi et al. 2019: DGX-2H has 8 x 100 Gb/s InfiniBand "100 GB/sec between servers"
    # for 16 GPUs: 6.25 GB/s per GPU; ~90% achievable.
    "ib-edr-dgx2": Link("InfiniBand EDR (DGX-2H)", 5.6 * GB, 8e-6),
    # RoCE v2 at 400 GbE per GPU (e.g. Llama 3 paper's RoCE cluster, Dubey et al. 2024);
    # ~80% achievable.
    "roce-400": Link("RoCE 400 GbE", 40 * GB, 10e-6),
    # One 100 GbE port per node (12.5 GB/s) shared by 8 GPUs: ~1.4 GB/s each at ~90%.
    "eth-100": Link("Ethernet 100 GbE (shared by 8)", 1.4 * GB, 30e-6),
    # Same-host gloo over shared memory/TCP loopback: order of magnitude only; measure it
    # with `tpkit calibrate`.
    "loopback": Link("loopback (gloo)", 2 * GB, 50e-6),
}


def _hw(name: str, acc: str, intra: str, inter: str, per_node: int = 8) -> Hardware:
    return Hardware(name, ACCELERATORS[acc], LINKS[intra], LINKS[inter], per_node)


# DGX A100 / DGX H100 / DGX H200 / DGX B200: 8 GPUs per node (NVIDIA datasheets);
# DGX-2H: 16 V100 per node (Shoeybi et al. 2019).
PROFILES: dict[str, Hardware] = {
    "a100-40gb": _hw("a100-40gb", "a100-40gb", "nvlink3", "ib-hdr"),
    "a100-80gb": _hw("a100-80gb", "a100-80gb", "nvlink3", "ib-hdr"),
    "h100": _hw("h100", "h100", "nvlink4", "ib-ndr"),
    "h200": _hw("h200", "h200", "nvlink4", "ib-ndr"),
    "b200": _hw("b200", "b200", "nvlink5", "ib-ndr"),
    "dgx2h": _hw("dgx2h", "v100-dgx2h", "nvswitch-v100", "ib-edr-dgx2", 16),
    "cpu": _hw("cpu", "cpu", "loopback", "eth-100", 1),
}


class HardwareError(UserError):
    """An unknown profile name or a malformed profile file."""


def default_local_path() -> Path:
    """Where `tpkit calibrate` writes and `--hardware local` reads ($TPKIT_CACHE or ~/.cache)."""
    root = os.environ.get("TPKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tpkit")
    return Path(root) / "local.toml"


def get_hardware(name: str, file: str | os.PathLike | None = None) -> Hardware:
    """A profile by name: from `file` if given, then the built-ins, then the local one."""
    if file is not None:
        found = load_profiles(file)
        if name in found:
            return found[name]
        if name not in PROFILES:
            raise HardwareError(f"profile {name!r} is neither in {file} ({', '.join(found)}) "
                                f"nor built in ({', '.join(PROFILES)})")
    if name in PROFILES:
        return PROFILES[name]
    if name == "local":
        path = default_local_path()
        if not path.exists():
            raise HardwareError(f"no calibrated profile at {path}; run `tpkit calibrate` first "
                                f"(or pass --hardware-file)")
        return load_profiles(path)["local"]
    raise HardwareError(f"unknown hardware {name!r}; built in: {', '.join(PROFILES)}, local "
                        f"(after `tpkit calibrate`), or a name from --hardware-file")


def load_profiles(path: str | os.PathLike) -> dict[str, Hardware]:
    """Read every `[name]` table of a TOML file into a Hardware profile."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise HardwareError(f"cannot read hardware file {path}: {e}") from None
    return {name: profile_from_dict(name, table) for name, table in data.items()
            if isinstance(table, dict)}


def profile_from_dict(name: str, d: dict) -> Hardware:
    """Build a profile from human units (TFLOP/s, GB, GB/s, microseconds); see the module doc."""
    base = PROFILES.get(d.get("base", "")) or PROFILES["cpu"]
    if "base" in d and d["base"] not in PROFILES:
        raise HardwareError(f"[{name}] base={d['base']!r} is not a built-in profile")
    acc, intra, inter = base.accelerator, base.intra, base.inter
    acc = replace(acc, name=d.get("accelerator", acc.name if "base" in d else name),
                  **_scaled(d, {"peak_tflops": ("peak_flops", TFLOPS),
                                "memory_gb": ("memory_bytes", GB),
                                "mem_bandwidth_gbs": ("mem_bandwidth", GB),
                                "gemm_efficiency": ("gemm_efficiency", 1.0),
                                "gemm_half_dim": ("gemm_half_dim", 1.0),
                                "op_overhead_us": ("op_overhead", 1e-6)}))
    if "dtype" in d:
        acc = replace(acc, dtype=str(d["dtype"]))
    intra = _link(d, "intra", intra)
    inter = _link(d, "inter", inter)
    per_node = int(d.get("devices_per_node", base.devices_per_node))
    if per_node < 1 or acc.peak_flops <= 0 or intra.bandwidth <= 0 or inter.bandwidth <= 0:
        raise HardwareError(f"[{name}] devices_per_node, peak_tflops and bandwidths must be > 0")
    return Hardware(name, acc, intra, inter, per_node, int(d.get("cores_per_node", base.cores_per_node)),
                    float(d.get("shared_latency_us", base.shared_latency / 1e-6)) * 1e-6,
                    int(d.get("nics_per_node", base.nics_per_node)))


def _scaled(d: dict, keys: dict[str, tuple[str, float]]) -> dict:
    return {field: float(d[key]) * unit for key, (field, unit) in keys.items() if key in d}


def _link(d: dict, which: str, default: Link) -> Link:
    link = default
    if f"{which}_name" in d:  # a measured link (`tpkit calibrate`), named by its transport
        link = replace(link, name=str(d[f"{which}_name"]))
    if f"{which}_link" in d:
        if d[f"{which}_link"] not in LINKS:
            raise HardwareError(f"{which}_link={d[f'{which}_link']!r} is not one of "
                                f"{', '.join(LINKS)}")
        link = LINKS[d[f"{which}_link"]]
    link = replace(link, overlap=bool(d.get(f"{which}_overlap", link.overlap)))
    return replace(link, **_scaled(d, {f"{which}_bandwidth_gbs": ("bandwidth", GB),
                                       f"{which}_latency_us": ("latency", 1e-6),
                                       f"{which}_scalar_latency_us": ("scalar_latency", 1e-6)}))


def profile_to_toml(hw: Hardware, comments: dict[str, str] | None = None) -> str:
    """The TOML text of one profile (what `load_profiles` reads back)."""
    a = hw.accelerator
    fields = {"accelerator": a.name, "dtype": a.dtype, "devices_per_node": hw.devices_per_node,
              "peak_tflops": a.peak_flops / TFLOPS, "memory_gb": a.memory_bytes / GB,
              "mem_bandwidth_gbs": a.mem_bandwidth / GB, "gemm_efficiency": a.gemm_efficiency,
              "gemm_half_dim": a.gemm_half_dim, "op_overhead_us": a.op_overhead / 1e-6,
              "cores_per_node": hw.cores_per_node,
              "shared_latency_us": hw.shared_latency / 1e-6, "nics_per_node": hw.nics_per_node,
              "intra_name": hw.intra.name, "inter_name": hw.inter.name,
              "intra_bandwidth_gbs": hw.intra.bandwidth / GB,
              "intra_latency_us": hw.intra.latency / 1e-6,
              "inter_bandwidth_gbs": hw.inter.bandwidth / GB,
              "inter_latency_us": hw.inter.latency / 1e-6,
              "intra_overlap": hw.intra.overlap, "inter_overlap": hw.inter.overlap}
    fields.update({f"{which}_scalar_latency_us": link.scalar_latency / 1e-6
                   for which, link in (("intra", hw.intra), ("inter", hw.inter))
                   if link.scalar_latency is not None})
    lines = [f"[{hw.name}]"]
    for key, value in fields.items():
        text = f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(
            value, bool) else str(value) if isinstance(value, int) else f"{value:.6g}"
        note = f"  # {comments[key]}" if comments and key in comments else ""
        lines.append(f"{key} = {text}{note}")
    return "\n".join(lines) + "\n"


_DEVICE_PROFILES = (("b200", "b200"), ("h200", "h200"), ("h100", "h100"),
                    ("a100-sxm4-80gb", "a100-80gb"), ("a100 80gb", "a100-80gb"),
                    ("a100", "a100-40gb"), ("v100", "dgx2h"))


def profile_of_device(device_name: str) -> Hardware | None:
    """The built-in profile of a GPU named as its driver names it ('NVIDIA
    H100 80GB HBM3' -> h100), 'cpu' -> the calibrated local profile if there is one;
    None when unknown (utilisation is then not reported against a peak)."""
    name = device_name.lower()
    if name == "cpu":
        path = default_local_path()
        return load_profiles(path).get("local") if path.exists() else None
    return next((PROFILES[p] for key, p in _DEVICE_PROFILES if key in name), None)
