"""The documentation site builds, strictly (`mkdocs build --strict`, as `make docs`): a
link to a page or an anchor that is not there, a page left out of the navigation, a name
the Python API page shows that the code no longer has (mkdocstrings), or a reference
page that cannot be generated from the declarations (docs/hooks.py) fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_site_builds_strictly(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    config = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "--collective-timeout" in cli and "--served-model-name" in cli
    assert "ckpt_every" in config and "[optimizer]" in config
