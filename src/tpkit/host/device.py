"""The one place that touches `torch.cuda`: backend choice, per-rank device, sync; and
what this machine's processors accelerate (`cpu_flags`, `gpu_bf16`).

CPU and GPU are both first-class: under gloo every rank computes on the CPU, under
nccl rank `LOCAL_RANK` computes on `cuda:LOCAL_RANK`.
"""

from __future__ import annotations

from pathlib import Path

import torch

# /proc/cpuinfo flags that make a low-precision matmul fast on the CPU (oneDNN uses them)
LOW_PRECISION_FLAGS = {"bfloat16": ("amx_bf16", "amx_tile", "avx512_bf16"),
                       "float16": ("amx_fp16", "amx_tile", "avx512_fp16")}


def cuda_available() -> bool:
    """True when at least one CUDA device is visible."""
    return torch.cuda.is_available()


def gpu_names() -> list[str]:
    """The names of the visible CUDA devices, in index order (empty on a CPU machine)."""
    if not cuda_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def device_name(device: torch.device) -> str:
    """A device's name as its driver gives it ("NVIDIA H100 80GB HBM3"), "cpu" for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def default_backend() -> str:
    """nccl when CUDA is available, else gloo."""
    return "nccl" if cuda_available() else "gloo"


def device_for(backend: str, local_rank: int = 0) -> torch.device:
    """The device a rank computes on: cuda:LOCAL_RANK under nccl, cpu under gloo."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def best_device() -> torch.device:
    """cuda:0 when a GPU is visible, else the CPU (single-process runs)."""
    return device_for(default_backend(), 0)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on `device` (a no-op on the CPU), for honest timings."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rng_state(device: torch.device) -> torch.Tensor:
    """The generator state of `device` (CPU or CUDA)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Restore a state returned by `rng_state`."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def gpu_bf16() -> bool:
    """Whether the visible CUDA device computes in bfloat16 natively (False without one)."""
    return cuda_available() and torch.cuda.is_bf16_supported()
