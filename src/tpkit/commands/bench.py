"""`tpkit bench`: run the benchmarks of benchmarks/ against peers, one script at a time.

    tpkit bench                  # every benchmark (make bench)
    tpkit bench --only mlp       # benchmarks/mlp_vs_peers.py
    tpkit bench --only block --quick

Each script runs in its own process with this Python, prints its table and writes
bench-results/<name>.json. Benchmarks report ratios measured in one run; they
assert nothing (see STYLE.md). A script that is not there yet is skipped, saying so.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

SCRIPTS = {"mlp": "mlp_vs_peers.py", "block": "block_vs_peers.py",
           "bubble": "pipeline_bubble.py"}


def benchmarks_dir() -> Path:
    """benchmarks/ of the checkout this package is installed from (editable install)."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tpkit bench`."""
    parser.add_argument("--only", choices=[*SCRIPTS, "all"], default="all",
                        help="which benchmark to run (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer shapes and rounds: a smoke run, not figures to quote")
    parser.add_argument("--dir", type=Path, default=None,
                        help="folder holding the scripts (default: the checkout's benchmarks/)")


def run(args: argparse.Namespace) -> int:
    """Run the chosen scripts in turn; the exit status is the first failure's, else 0."""
    folder = args.dir or benchmarks_dir()
    names = list(SCRIPTS) if args.only == "all" else [args.only]
    status, ran = 0, 0
    for name in names:
        script = folder / SCRIPTS[name]
        if not script.is_file():
            print(f"tpkit bench: skipping {name}: {script} does not exist (yet)")
            continue
        cmd = [sys.executable, str(script), *(["--quick"] if args.quick else [])]
        print(f"tpkit bench: {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd, cwd=folder.parent)
        ran += 1
        if rc != 0:
            print(f"tpkit bench: {name} failed with exit status {rc}", file=sys.stderr)
            status = status or rc
    if ran == 0:
        print(f"tpkit bench: no benchmark script found in {folder}", file=sys.stderr)
        return 2
    return status
