"""`tpkit train` starts the forkserver its ranks are forked from before it imports torch
itself (`tpkit.host.forkserver.start_early`) when its command line names several ranks,
so that both imports run at once; a run that turns out to be one process stops it, and
one that forked from it keeps it. Each case in a fresh process: this one's forkserver is
the test pools'."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
CASES = """
import os, sys
from multiprocessing import forkserver as mf
from tpkit.host import forkserver as F

def alive(pid):
    try:
        os.kill(pid, 0)
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except (ProcessLookupError, ChildProcessError):
        return False

F.start_early("plan", ["--nodes", "2"])  # a command that forks no ranks: nothing
print("plan", mf._forkserver._forkserver_pid)
F.start_early("train", ["--tp", "2", "--help"])
print("help", mf._forkserver._forkserver_pid)
F.start_early("train", ["--tp", "2"])
pid = mf._forkserver._forkserver_pid
print("started", pid is not None, "torch" in sys.modules,
      all(m in F.PRELOAD for m in ("torch", "torch._dynamo", "tpkit.commands.train")))
F.stop_early()  # alone after all
print("stopped", alive(pid), mf._forkserver._forkserver_pid)
F.start_early("train", ["--preset", "gpt2-tiny"])  # one rank, by the command line
print("one", mf._forkserver._forkserver_pid)
F.start_early("train", ["--processes=4"])
pid = mf._forkserver._forkserver_pid
F.context()  # what start_workers takes before it forks the ranks
F.stop_early()
print("kept", alive(pid))
mf._forkserver._stop()
os.environ.update(RANK="0", WORLD_SIZE="2")  # torchrun started the ranks
F.start_early("train", ["--tp", "2"])
print("torchrun", mf._forkserver._forkserver_pid)
"""


def test_train_starts_its_forkserver_early_and_stops_it_when_alone():
    r = subprocess.run([sys.executable, "-c", CASES], capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["plan None", "help None", "started True False True",
                                     "stopped False None", "one None", "kept True",
                                     "torchrun None"]


def test_a_mistake_on_the_command_line_stops_the_forkserver_at_once():
    """`--tp 2` started one early; the bad --steps ends the command before any rank: the
    command stops it on its way out (otherwise it would finish its imports first)."""
    code = """
import sys
from multiprocessing import forkserver as mf
from tpkit import cli
try:
    status = cli.main(["train", "--tp", "2", "--steps", "five"])
except SystemExit as e:
    status = e.code
print(status, mf._forkserver._forkserver_pid)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "--steps" in r.stderr, r.stderr[-2000:]
    assert r.stdout.split() == ["2", "None"], r.stdout
