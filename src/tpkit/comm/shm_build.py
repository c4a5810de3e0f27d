"""Build and load the shared-memory kernels (`shm.cpp`, a plain C++ library called with ctypes).

    python -m tpkit.comm.shm_build        # what `make` runs after installing: compiles once

The library lands in `comm/_shm_build/` (ignored by git), named after a hash of the
sources (`shm.cpp` and the arithmetic it includes, `shm_reduce.h`), so an edited `shm.cpp` is rebuilt and a stale library is never loaded. Built
with g++ in well under a second; nothing is downloaded. If it cannot be built (no
compiler), `load()` returns None and tpkit runs every group on gloo.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("shm.cpp")
HEADER = SOURCE.with_name("shm_reduce.h")  # included by shm.cpp
BUILD_DIR = Path(__file__).with_name("_shm_build")
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing"]
_P, _I, _Z, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_double
# name -> (argument types, return type). The collectives have none declared: declared
# types cost ~1.5 us of conversion a call (a third of a small all-reduce), so `shm.py`
# passes ctypes objects (c_void_p, c_size_t, c_double; small ints as c_int) itself.
_SIGNATURES = {
    "tpk_map": ([ctypes.c_char_p, _Z, _I], _P),
    "tpk_unmap": ([_P, _Z], _I),
    "tpk_unlink": ([ctypes.c_char_p], _I),
    "tpk_size": ([_I, _Z], _Z),
    "tpk_init": ([_P, _I, _Z], _I),
    "tpk_join": ([_P, _I, _I], _I),
    "tpk_all_reduce": (None, _I),  # base, rank, x, numel, dtype, op, split, timeout, who
    "tpk_reduce_scatter": (None, _I),  # base, rank, in, out, count, dtype, op, timeout, who
    "tpk_all_gather": (None, _I),  # base, rank, in, out, nbytes, timeout, who
    "tpk_broadcast": (None, _I),  # base, rank, x, nbytes, root, timeout, who
    "tpk_send": (None, _I),  # base, rank, x, nbytes, dst, timeout, who
    "tpk_recv": (None, _I),  # base, rank, x, nbytes, src, timeout, who
}


def library_path() -> Path:
    """Where the library built from today's `shm.cpp` lives."""
    text = SOURCE.read_bytes() + HEADER.read_bytes() + " ".join(FLAGS).encode()
    digest = hashlib.sha256(text).hexdigest()[:12]
    return BUILD_DIR / f"libtpkit_shm-{digest}.so"


def build(force: bool = False) -> Path:
    """Compile `shm.cpp` (atomically: ranks building at once never load half a file)."""
    target = library_path()
    if target.exists() and not force:
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++) found")
    BUILD_DIR.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=BUILD_DIR, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lrt"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, target)
        for old in BUILD_DIR.glob("libtpkit_shm-*.so"):  # earlier sources' builds
            if old != target:
                old.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=1)  # one load per process (the library is immutable)
def load() -> ctypes.CDLL | None:
    """The loaded library (building it first if needed), or None if it cannot be had.
    TPKIT_SHM_DISABLE=1 pretends it cannot (to test the fallback to gloo)."""
    if os.environ.get("TPKIT_SHM_DISABLE") == "1":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError):
        return None
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def unavailable_reason() -> str:
    """Why `load()` gives None (for the one warning line)."""
    if os.environ.get("TPKIT_SHM_DISABLE") == "1":
        return "TPKIT_SHM_DISABLE=1"
    try:
        build()
    except (OSError, subprocess.SubprocessError) as e:
        return str(e).splitlines()[0]
    return "it did not load"


def main() -> int:
    """Build the library; print where it is."""
    try:
        print(f"tpkit shm kernels: {build()}")
    except (OSError, subprocess.SubprocessError) as e:
        print(f"tpkit shm kernels not built ({e}); groups will use gloo", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
