"""A failing test fails the run: importing tpkit, or any module of it, never changes how
the importing process exits (an `atexit` handler calling `os._exit(0)` once turned every
failing `make test` into exit 0)."""

from __future__ import annotations

import subprocess
import sys

FAILING = '''
import importlib, pkgutil
import tpkit

def test_fails_after_importing_every_module():
    for m in pkgutil.walk_packages(tpkit.__path__, "tpkit."):
        importlib.import_module(m.name)
    assert False, "this test must fail"
'''


def test_a_failing_test_exits_nonzero_after_every_tpkit_import(tmp_path):
    """pytest on one failing test that imports every tpkit module exits 1, and says so."""
    (tmp_path / "test_probe.py").write_text(FAILING)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(tmp_path / "test_probe.py")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert "1 failed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:])


def test_importing_every_module_keeps_the_exit_status():
    """`import <module>; raise SystemExit(3)` exits 3 for every module of the package."""
    code = ("import importlib, pkgutil, tpkit\n"
            "for m in pkgutil.walk_packages(tpkit.__path__, 'tpkit.'):\n"
            "    importlib.import_module(m.name)\n"
            "raise SystemExit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])


def _forkserver_exit_active(mesh) -> bool:
    import tpkit.host.forkserver_exit as fse
    return fse.ACTIVE


def test_the_forkserver_still_skips_its_teardown(pools):
    """The handler is armed in the forkserver (a worker, forked from it, sees it armed)
    and nowhere else (this process imported the module too)."""
    import tpkit.host.forkserver_exit as fse

    assert fse.ACTIVE is False
    assert pools.run(_forkserver_exit_active, 2, mesh=dict(tp=2)) == [True, True]


def _ci_with_make_printing(tmp_path, summary: str, status: int) -> int:
    """Run the repository's .ci/run with a stand-in `make` that prints `summary` and exits
    with `status` (the real `make test` is the suite itself)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "make").write_text(f"#!/bin/sh\necho '{summary}'\nexit {status}\n")
    (fake / "make").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin"}
    return subprocess.run(["bash", str(root / ".ci" / "run")], env=env, capture_output=True,
                          text=True, timeout=30).returncode


def test_ci_fails_on_a_reported_failure_even_when_make_exits_0(tmp_path):
    for i, summary in enumerate(["1 failed, 462 passed in 3.1s", "462 passed, 2 errors in 3.1s"]):
        sub = tmp_path / str(i)
        sub.mkdir()
        assert _ci_with_make_printing(sub, summary, 0) == 1, summary


def test_ci_passes_a_clean_summary_and_fails_a_missing_one_or_a_failed_make(tmp_path):
    for i, (summary, status, want) in enumerate([("462 passed, 1 skipped in 3.1s", 0, 0),
                                                 ("no tests ran", 0, 1),
                                                 ("462 passed in 3.1s", 2, 2)]):
        sub = tmp_path / str(i)
        sub.mkdir()
        assert _ci_with_make_printing(sub, summary, status) == want, summary
