"""Names a package resolves on first use (PEP 562), so that importing it stays light:
`import tpkit` imports no torch until `tpkit.load` is used, `tpkit.checkpoint` and
`tpkit.weights` load their modules only when a name of theirs is asked for.

    __getattr__, __dir__ = lazy_names("tpkit.weights", {"locate": "tpkit.weights.paths"},
                                      globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_names(package: str, homes: dict[str, str | tuple[str, str]], namespace: dict
               ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module `__getattr__` and `__dir__` of `package`: `homes` maps each public name
    to the module that defines it, or to (module, its name there); `dir()` lists them
    beside the package's own `namespace` without importing anything."""
    def __getattr__(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = (home, name) if isinstance(home, str) else home
        return getattr(importlib.import_module(module), attr)

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
