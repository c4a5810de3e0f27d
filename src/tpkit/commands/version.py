"""`tpkit version` (and `tpkit --version`, one line): what this installation runs on.

    tpkit version
    tpkit 0.1.0 (python 3.11.7)
      torch          2.13.0+cpu
      transformers   5.24.0
      tensorboard    2.21.0          (--trackers tensorboard)
      mlflow         mlflow-skinny 3.17.2 (--trackers mlflow)
      ...
    transports:
      gloo           available (CPU processes)
      nccl           not built (a CPU build of torch)
      shm            available (groups whose ranks share a host: --comm auto or shm)
    devices:         cpu, 16 threads
    fast paths:
      cpu            AVX512 (torch's kernels for this processor)
      float32        decode products of <= 8 rows split over the 16 threads
      bfloat16       accelerated (avx512_bf16; oneDNN): --dtype bfloat16's matmuls use it;
                     decoding packs the weights for it once
      float16        not accelerated (no amx_fp16, amx_tile, avx512_fp16): --dtype float16
                     is emulated, slower than float32 here
      attention      decode rows: one native call a layer (float32, bfloat16)
      cuda           none

`--version` reads package metadata only (no torch import: instant); `tpkit version`
imports torch to ask torch.distributed which backends it was built with, and which
fast paths a `--dtype` of generate or serve has here (the processor's flags in
/proc/cpuinfo, oneDNN, a GPU through `tpkit.host.device`).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
from collections.abc import Callable
from importlib import metadata

from tpkit.spec.words import plural

PACKAGES = (  # (module tpkit imports, what needs it)
    ("torch", ""), ("transformers", "--from-hf, tokenizers"),
    ("tensorboard", "--trackers tensorboard"), ("wandb", "--trackers wandb"),
    ("mlflow", "--trackers mlflow"), ("trackio", "--trackers trackio"),
    ("pyarrow", "prepare-data .parquet"), ("datasets", "prepare-data of a save_to_disk folder"),
)


def version_of(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def module_version(module: str) -> str | None:
    """The version of whatever distribution provides the importable `module` (the one
    tpkit imports: `mlflow` comes from mlflow or mlflow-skinny), naming that distribution
    when its name differs; None when `module` cannot be imported."""
    if importlib.util.find_spec(module) is None:  # as `--trackers` checks (train/trackers)
        return None
    for dist in metadata.packages_distributions().get(module, []) + [module]:
        v = version_of(dist)
        if v is not None:
            same = dist.lower().replace("_", "-") == module.lower().replace("_", "-")
            return v if same else f"{dist} {v}"
    return "version unknown"


def one_line() -> str:
    """'tpkit 0.1.0 (torch 2.13.0+cpu, transformers 5.24.0, python 3.11.7)'."""
    parts = [f"{d} {version_of(d)}" for d in ("torch", "transformers") if version_of(d)]
    return (f"tpkit {version_of('tpkit') or 'unknown (not installed)'} "
            f"({', '.join(parts + [f'python {platform.python_version()}'])})")


def _gloo() -> str:
    # lazy: `tpkit version` runs, and says so, without torch
    import torch.distributed as dist

    return "available (CPU processes)" if dist.is_gloo_available() else "not built"


def _nccl() -> str:
    # lazy: `tpkit version` runs, and says so, without torch
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return "not built (a CPU build of torch)" if torch.version.cuda is None else "not built"
    from tpkit.host.device import gpu_names

    return f"available ({plural(len(gpu_names()), 'GPU')} visible)"


def _shm() -> str:
    # lazy: as above (torch)
    from tpkit.comm.shm_build import load, unavailable_reason

    if load() is not None:
        return "available (groups whose ranks share a host: --comm auto or shm)"
    return f"unavailable ({unavailable_reason()}): every group uses gloo"


# The transports `tpkit.comm` can send collectives over: (name, probe -> state). A new
# transport adds its probe here.
TRANSPORTS: list[tuple[str, Callable[[], str]]] = [("gloo", _gloo), ("nccl", _nccl),
                                                   ("shm", _shm)]


def transports() -> list[tuple[str, str]]:
    """(name, state) of each transport, a probe's failure reported as its state."""
    out = []
    for name, probe in TRANSPORTS:
        try:
            out.append((name, probe()))
        except Exception as e:  # noqa: BLE001 - a broken backend is a state to show
            out.append((name, f"unavailable ({type(e).__name__}: {e})"))
    return out


def _devices() -> str:
    # lazy: `tpkit version` runs, and says so, without torch
    import torch

    from tpkit.host.device import gpu_names

    return ", ".join(["cpu"] + gpu_names()) + f"; {torch.get_num_threads()} CPU threads"


def fast_paths() -> list[tuple[str, str]]:
    """(name, state): torch's CPU capability, whether bfloat16 and float16 matmuls are
    accelerated on this CPU (its flags and oneDNN), whether the decode rows' attention
    kernel is built, and the GPU when there is one."""
    # lazy: `tpkit version` runs, and says so, without torch
    import torch

    from tpkit.host.device import LOW_PRECISION_FLAGS, cpu_flags, gpu_bf16, gpu_names

    flags, onednn = cpu_flags(), torch.backends.mkldnn.is_available()
    from tpkit.decode.forms import PackedWeight
    from tpkit.kernels import decode_ops

    native = decode_ops.load() is not None
    out = [("cpu", f"{torch.backends.cpu.get_cpu_capability()} (torch's kernels for this "
                   f"processor)"),
           ("decode", f"native products, norms and rotary for up to {decode_ops.ROWS} rows "
                      f"(float32, bfloat16, int8 weights; {decode_ops.load().tpk_decode_ops_lanes()}"
                      f"-lane sums), a step's layers in one call (tp > 1: the "
                      f"shared-memory all-reduces inside it; greedy: the embedding, head "
                      f"and token pick too)" if native else
                      f"torch's ops (native decode kernels unavailable: "
                      f"{decode_ops.LIBRARY.unavailable_reason()})"),
           ("float32", "decoding multiplies a step's rows natively" if native else
                       "decoding packs the weights for oneDNN once, on every thread"
                       if PackedWeight.available(torch.float32)
                       else "no oneDNN in this torch: decode products as F.linear's")]
    for dtype, wanted in LOW_PRECISION_FLAGS.items():
        has = [f for f in wanted if f in flags]
        fast = bool(set(has) - {"amx_tile"}) and onednn
        why = ", ".join(has) + ("; oneDNN" if onednn else "; no oneDNN in this torch")
        packed = "; decoding packs the weights for it once" \
            if PackedWeight.available(getattr(torch, dtype)) and not native else ""
        if dtype == "bfloat16" and native:
            packed = "; a decode step's rows multiplied natively"
        out.append((dtype, f"accelerated ({why}): --dtype {dtype}'s matmuls use it{packed}"
                    if fast
                    else f"not accelerated ({why if has else 'no ' + ', '.join(wanted)}): "
                         f"--dtype {dtype} is emulated, slower than float32 here"
                         f"{packed.replace('; a', ' except a') if packed else ''}"))
    from tpkit.kernels import paged_attention

    out.append(("attention", "decode rows: one native call a layer (float32, bfloat16)"
                if paged_attention.load() is not None else
                f"decode rows on SDPA, one call a sequence (native kernel unavailable: "
                f"{paged_attention.LIBRARY.unavailable_reason()})"))
    gpus = gpu_names()
    out.append(("cuda", f"{', '.join(gpus)} (bfloat16 {'native' if gpu_bf16() else 'emulated'})"
                if gpus else "none"))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    """Print the versions, transports and devices."""
    print(f"tpkit {version_of('tpkit') or 'unknown'} (python {platform.python_version()}, "
          f"{platform.system().lower()} {platform.machine()})")
    for module, use in PACKAGES:
        v = module_version(module) or "not installed"
        print(f"  {module:<14} {v:<16}{f' ({use})' if use else ''}".rstrip())
    print("transports:")
    for name, state in transports():
        print(f"  {name:<14} {state}")
    print(f"devices:         {_devices()}")
    print("fast paths:")
    for name, state in fast_paths():
        print(f"  {name:<14} {state}")
    return 0
