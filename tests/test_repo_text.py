"""The repository's own text stays true to its code: no merge-conflict markers left in
any file, every `dir/file.py` path the docs name exists, and every dotted `tpkit.x.y`
name in the docs, the package and the benchmarks resolves (a module, or an attribute of
one). A module moved without its mentions fails here, naming the file that still says
the old place."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*sorted(ROOT.glob("docs/**/*.md")), ROOT / "README.md"]
CODE = [*sorted(ROOT.glob("src/tpkit/**/*.py")), *sorted(ROOT.glob("benchmarks/*.py"))]
TEXT = [*DOCS, *CODE, *sorted(ROOT.glob("tests/*.py")), ROOT / "Makefile", ROOT / "pyproject.toml",
        *sorted(ROOT.glob("examples/*"))]
MARKER = re.compile(r"^(<{7}|>{7})( |$)|^={7}$", re.M)
PATH = re.compile(r"(?<![\w/.-])((?:[a-z_0-9]+/)+[a-z_0-9]+\.(?:py|cpp|h|toml|json))\b")
OUTPUTS = ("run/", "runs/")  # what a run writes, not files of the repository
DOTTED = re.compile(r"(?<![\w.])tpkit(?:\.[A-Za-z_]\w*)+")


def test_no_merge_conflict_markers():
    found = [f"{f.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
             for f in TEXT if f.is_file() for text in [f.read_text(errors="replace")]
             for m in MARKER.finditer(text)]
    assert found == []


def test_paths_named_in_the_docs_exist():
    bases = (ROOT, ROOT / "src" / "tpkit", ROOT / "src")
    missing = [f"{f.relative_to(ROOT)}: {p}" for f in DOCS for p in PATH.findall(f.read_text())
               if not p.startswith(OUTPUTS) and not any((b / p).exists() for b in bases)]
    assert missing == []


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module
        try:  # a name below a plain module (not a package) is no module
            spec = importlib.util.find_spec(".".join(parts[:i]))
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            obj = importlib.import_module(spec.name)
            break
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def test_dotted_tpkit_names_resolve():
    names: dict[str, str] = {}
    for f in [*DOCS, *CODE]:
        for m in DOTTED.finditer(f.read_text()):
            names.setdefault(m.group(0), str(f.relative_to(ROOT)))
    stale = [f"{where}: {name}" for name, where in sorted(names.items()) if not _resolves(name)]
    assert stale == [], stale
