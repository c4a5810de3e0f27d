"""The public Python entry points: `tpkit.load`, `model.generate`, `tpkit.spawn`.

Checked: `import tpkit` imports no torch (the names resolve on first use); docs/python.md's
example runs as written (a tp=2 model generates the tokens of the
tp=1 model); `tpkit.load` refuses a tp it cannot honour in one line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"))


def test_import_tpkit_imports_no_torch():
    code = ("import sys, tpkit; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert tpkit.load.__name__ == 'load' and 'torch' in sys.modules; "
            "assert tpkit.spawn.__name__ == 'spawn_ranks'; "
            "assert tpkit.ParallelMesh.__name__ == 'ParallelMesh'\n"
            "try:\n    tpkit.nothing\nexcept AttributeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "has no attribute 'nothing'" in out.stdout


def test_commands_start_without_dynamo():
    """torch.compile's Dynamo costs as much CPU to import as torch itself: the commands
    that run models import it only when --compile asks for it (`comm.compile_ready`)."""
    code = ("import sys, tpkit.commands.train, tpkit.commands.generate, tpkit.commands.serve, "
            "tpkit.commands.verify, tpkit.train.loop, tpkit.launch; "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def readme_example() -> str:
    section = (ROOT / "docs" / "python.md").read_text()
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_example_runs(tmp_path):
    from checkpoint_helpers import LLAMA
    from tpkit.checkpoint import store
    from tpkit.mesh import ParallelMesh
    from tpkit.model.transformer import Transformer

    store.save(tmp_path / "ckpt", Transformer(LLAMA, ParallelMesh.single(), seed=4))
    (tmp_path / "example.py").write_text(readme_example())
    out = subprocess.run([sys.executable, str(tmp_path / "example.py"), str(tmp_path / "ckpt")],
                         env=_env(), capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tp=1 and tp=2 agree" in out.stdout


def test_load_without_processes_refuses_tp2(tmp_path):
    import tpkit
    from tpkit.spec.errors import UserError

    with pytest.raises(UserError, match=r"tp=2 needs 2 processes: call tpkit.load inside "
                                        r"tpkit.spawn\(fn, 2\)"):
        tpkit.load(tmp_path, tp=2)
