"""`make demo`'s two verify steps, N times each, while busy loops load the cores:
how many runs fail, and how many saw a tp=1 reference that was not reproducible.

    .venv/bin/python benchmarks/verify_under_load.py [--runs 20] [--busy 2]

Not a test (it takes minutes and its outcome depends on the machine): it is the
measurement behind "verify is deterministic under load". Each run is a fresh
`tpkit verify` process, as `make demo` starts them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

STEPS = (["--preset", "gpt2-tiny", "--tp", "1,2,4"],
         ["--preset", "llama-tiny", "--tp", "1,2,4", "--sp"])


def _verify(argv: list[str]) -> tuple[bool, bool]:
    """(passed, reference was not reproducible) of one fresh `tpkit verify` run."""
    r = subprocess.run([sys.executable, "-m", "tpkit", "verify", *argv], capture_output=True,
                       text=True, timeout=900)
    return r.returncode == 0, "not reproducible" in r.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--busy", type=int, default=2, help="busy-loop processes")
    a = p.parse_args()
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(a.busy)]
    t0, rows = time.monotonic(), []
    try:
        for argv in STEPS:
            runs = [_verify(argv) for _ in range(a.runs)]
            rows.append((" ".join(argv), sum(not ok for ok, _ in runs),
                         sum(noted for _, noted in runs)))
    finally:
        for q in loops:
            q.kill()
            q.wait()
    print(f"{a.runs} runs per step, {a.busy} busy loops, {time.monotonic() - t0:.0f} s")
    print(f"{'tpkit verify':<40} {'failed':>7} {'reference not reproducible':>27}")
    for what, failed, noted in rows:
        print(f"{what:<40} {failed:>7} {noted:>27}")


if __name__ == "__main__":
    main()
