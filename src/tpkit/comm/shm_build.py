"""Build and load the shared-memory kernels (`shm.cpp`, a plain C++ library called with ctypes).

    python -m tpkit.comm.shm_build        # what `make` runs after installing: compiles once

Built by `comm.native.NativeLibrary` (the one builder of tpkit's C++ libraries) into
`comm/_shm_build/` (ignored by git), named after a hash of the sources (`shm.cpp` and the
arithmetic it includes, `shm_reduce.h`), so an edited `shm.cpp` is rebuilt and a stale
library is never loaded. Built with g++ in well under a second; nothing is downloaded. If
it cannot be built (no compiler), `load()` returns None and tpkit runs every group on gloo.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

from tpkit.comm.native import NativeLibrary

SOURCE = Path(__file__).with_name("shm.cpp")
HEADER = SOURCE.with_name("shm_reduce.h")  # included by shm.cpp
BUILD_DIR = Path(__file__).with_name("_shm_build")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing")
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
SHM = NativeLibrary("shm", (SOURCE, HEADER), BUILD_DIR, FLAGS, ("-lrt",), _SIGNATURES,
                    "TPKIT_SHM_DISABLE")


def library_path() -> Path:
    """Where the library built from today's `shm.cpp` lives."""
    return SHM.library_path()


def build(force: bool = False) -> Path:
    """Compile `shm.cpp` (atomically: ranks building at once never load half a file)."""
    return SHM.build(force)


@functools.lru_cache(maxsize=1)  # one load per process (the library is immutable)
def load() -> ctypes.CDLL | None:
    """The loaded library (building it first if needed), or None if it cannot be had.
    TPKIT_SHM_DISABLE=1 pretends it cannot (to test the fallback to gloo)."""
    return SHM.open()


def unavailable_reason() -> str:
    """Why `load()` gives None (for the one warning line)."""
    return SHM.unavailable_reason()


def main() -> int:
    """Build the library; print where it is."""
    return SHM.main("shm kernels", "groups will use gloo")


if __name__ == "__main__":
    sys.exit(main())
