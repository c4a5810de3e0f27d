"""Imports point down the stack only and never in a circle: the import-linter contracts
of pyproject.toml hold (spec at the bottom, commands at the top; spec and plan import no
torch; inside every package sibling modules import one way only), and a false contract
or a circle is reported broken, so this test can fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"

UPSIDE_DOWN = """
[importlinter]
root_package = tpkit
include_external_packages = True

[importlinter:contract:upside-down]
name = spec above plan
type = layers
containers = tpkit
layers =
    spec
    plan

[importlinter:contract:mesh-without-torch]
name = mesh imports no torch
type = forbidden
source_modules = tpkit.mesh
forbidden_modules = torch
"""


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    """lint-imports on this checkout's src/ (not whatever tpkit is installed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([str(LINT), "--no-cache", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept():
    out = lint_imports()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    declared = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"{declared} kept, 0 broken" in out.stdout  # every declared one was checked


CIRCLE = """
[importlinter]
root_package = circle

[importlinter:contract:acyclic]
name = no import circle
type = acyclic_siblings
ancestors = circle
"""


def test_an_import_circle_is_reported_broken(tmp_path):
    """Two modules of one package importing each other (even from inside a function)."""
    pkg = tmp_path / "circle"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "session.py").write_text("def run():\n    from circle import demos\n")
    (pkg / "demos.py").write_text("from circle.session import run\n")
    (tmp_path / "circle.ini").write_text(CIRCLE)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([str(LINT), "--no-cache", str(tmp_path / "circle.ini")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "No cycles are allowed in circle" in out.stdout, out.stdout[-3000:]


def test_a_false_contract_is_reported_broken(tmp_path):
    config = tmp_path / "upside_down.ini"
    config.write_text(UPSIDE_DOWN)
    out = lint_imports(str(config))
    assert out.returncode != 0
    assert "0 kept, 2 broken" in out.stdout, out.stdout[-3000:]
    assert "tpkit.plan is not allowed to import tpkit.spec" in out.stdout
    assert "tpkit.mesh is not allowed to import torch" in out.stdout
