"""Run the benchmarks of this folder against peers, one script at a time (`make bench`).

    python benchmarks/run_all.py                  # every benchmark
    python benchmarks/run_all.py --only mlp       # benchmarks/mlp_vs_peers.py
    python benchmarks/run_all.py --only block --quick

The benchmarks live in the source checkout, not in the installed package (a wheel has
no benchmarks/), so this runner lives beside them rather than as a `tpkit` command.
Each script runs in its own process with this Python, prints its table and writes
bench-results/<name>.json. Benchmarks report ratios measured in one run; they assert
nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {"mlp": "mlp_vs_peers.py", "block": "block_vs_peers.py",
           "bubble": "pipeline_bubble.py", "collectives": "collectives.py",
           "ledger": "ledger_overhead.py", "decode": "decode.py"}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen scripts in turn; the exit status is the first failure's, else 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=[*SCRIPTS, "all"], default="all",
                   help="which benchmark to run (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes and rounds: a smoke run, not figures to quote")
    args = p.parse_args(argv)
    status = 0
    for name in list(SCRIPTS) if args.only == "all" else [args.only]:
        cmd = [sys.executable, str(HERE / SCRIPTS[name]), *(["--quick"] if args.quick else [])]
        print(f"run_all: {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd, cwd=HERE.parent)
        if rc != 0:
            print(f"run_all: {name} failed with exit status {rc}", file=sys.stderr)
            status = status or rc
    return status


if __name__ == "__main__":
    raise SystemExit(main())
