"""Build and load tpkit's small C++ libraries (plain C++ called with ctypes, no torch header).

    lib = NativeLibrary("shm", (SOURCE, HEADER), BUILD_DIR, FLAGS, ...).open()

One builder for every such library: the shared-memory collectives (`comm/shm_build.py`)
and the paged decode attention (`kernels/paged_attention.py`), each built by `make` after
installing (and on first use if missing). A library lands in its `build_dir` (ignored by
git), named after a hash of its sources (the file compiled and the headers it includes)
and flags, so an edited source is rebuilt and a stale library is never loaded; built with
g++ in about a second, atomically (processes building at once never load half a file).
A library built for this CPU (`-march=native`) also hashes the CPU's model and feature
flags: a tree copied to another machine builds its own instead of loading one that may
use instructions this CPU lacks. Here, in `comm`, because the collectives are its lowest
user (`spec` is pure Python by contract); `layers` imports it from here.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@functools.lru_cache(maxsize=1)
def cpu_signature() -> bytes:
    """This CPU's model and feature flags (what `-march=native` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features",
                                                               "CPU part")]
    text = "\n".join(dict.fromkeys(keep)) or f"{platform.machine()} {platform.processor()}"
    return text.encode()


@dataclass(frozen=True)
class NativeLibrary:
    """One C++ library: `sources[0]` is compiled, the rest are the headers it includes
    (hashed, not compiled). `signatures`: name -> (argument types, return type); None
    argument types for the hot calls, whose callers pass ctypes objects themselves
    (declared types cost ~1.5 us of conversion a call). `disable_env`: a variable that,
    set to 1, makes `open()` give None (to test the fallback)."""

    name: str
    sources: tuple[Path, ...]
    build_dir: Path
    flags: tuple[str, ...]
    link: tuple[str, ...] = ()
    signatures: dict = field(default_factory=dict, hash=False, compare=False)
    disable_env: str = ""
    per_cpu: bool = False

    def library_path(self) -> Path:
        """Where the library built from today's sources lives."""
        text = b"".join(p.read_bytes() for p in self.sources) + " ".join(self.flags).encode()
        if self.per_cpu:
            text += cpu_signature()
        digest = hashlib.sha256(text).hexdigest()[:12]
        return self.build_dir / f"libtpkit_{self.name}-{digest}.so"

    def build(self, force: bool = False) -> Path:
        """Compile the library unless today's build exists; its path."""
        target = self.library_path()
        if target.exists() and not force:
            return target
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            raise OSError("no C++ compiler (g++) found")
        self.build_dir.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.build_dir, suffix=".so.tmp")
        os.close(fd)
        try:
            done = subprocess.run([compiler, *self.flags, "-o", tmp, str(self.sources[0]),
                                   *self.link], capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise OSError(f"{compiler} failed: {done.stderr.strip().splitlines()[-1:]}")
            os.replace(tmp, target)
            for old in self.build_dir.glob(f"libtpkit_{self.name}-*.so"):  # earlier builds
                if old != target:
                    old.unlink(missing_ok=True)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target

    def disabled(self) -> bool:
        """Whether `disable_env` asks to do without the library."""
        return bool(self.disable_env) and os.environ.get(self.disable_env) == "1"

    def open(self) -> ctypes.CDLL | None:
        """The loaded library (building it first if needed), or None if it cannot be had.
        Not cached: each user caches its one load per process."""
        if self.disabled():
            return None
        try:
            lib = ctypes.CDLL(str(self.build()))
        except (OSError, subprocess.SubprocessError):
            return None
        for name, (args, res) in self.signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        return lib

    def unavailable_reason(self) -> str:
        """Why `open()` gives None (for the one warning line)."""
        if self.disabled():
            return f"{self.disable_env}=1"
        try:
            self.build()
        except (OSError, subprocess.SubprocessError) as e:
            return str(e).splitlines()[0]
        return "it did not load"

    def main(self, what: str, without: str) -> int:
        """Build it; print where it is, or why not and what runs `without` it."""
        try:
            print(f"tpkit {what}: {self.build()}")
        except (OSError, subprocess.SubprocessError) as e:
            print(f"tpkit {what} not built ({e}); {without}", file=sys.stderr)
        return 0
