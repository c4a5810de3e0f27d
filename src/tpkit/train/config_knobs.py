"""One declaration per knob of `tpkit train`: a `TrainConfig` field made by
`Section.knob`, with its default, help, choices, checks and resume rule; its type is
the field's annotation. Everything else is generated from the declarations:

    OPTIMIZER = Section("optimizer", "AdamW and its learning rate")
    warmup: int = OPTIMIZER.knob(10, "warmup steps", check=COUNT)     # in TrainConfig

    tpkit train --help                   optimizer:   --warmup N  warmup steps (default: 10)
    [optimizer] warmup = 10              its key in a file (`tpkit.train.config_file`)
    warmup=-1 must be an integer >= 0    its check (`TrainConfig.problems`, exit 2)

A bool knob is a flag: --name when its default is False, --no-name when True.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from typing import Any

KNOB = "knob"  # the key of a field's metadata that holds its declaration


@dataclass(frozen=True)
class Check:
    """A rule on one value: `ok(value)`, or the problem 'name=value says'."""

    ok: Callable[[Any], bool]
    says: str

    def __call__(self, name: str, value) -> list[str]:
        """The problem of `value` (empty: none)."""
        return [] if self.ok(value) else [f"{name}={value} {self.says}"]


POSITIVE_INT = Check(lambda v: v >= 1, "must be a positive integer")
COUNT = Check(lambda v: v >= 0, "must be an integer >= 0")
AT_LEAST_0 = Check(lambda v: v >= 0, "must be a number >= 0")


@dataclass(frozen=True)
class Section:
    """A group of knobs: one TOML section, one heading of `tpkit train --help`."""

    name: str
    about: str  # one line under the heading

    def knob(self, default, help: str, *, choices: Iterable | None = None,
             check: Callable[[str, Any], list[str]] | None = None, flag: str | None = None,
             metavar: str | None = None, path: bool = False, fixed: str | None = None,
             noted: bool = True, old_flags: tuple[str, ...] = ()) -> Any:
        """A dataclass field declaring a knob of this section. `check(name, value)` lists
        its problems; `flag` replaces --name; `old_flags`: its former spellings, still
        read (deprecated); `path`: a file or folder (written another way, ./x and x, it
        is the same); `fixed`: why a resumed run cannot change it; `noted=False`: a
        resume does not name its change."""
        return field(default=default, metadata={KNOB: dict(
            section=self, help=help, choices=None if choices is None else tuple(choices),
            check=check, flag=flag, metavar=metavar, path=path, fixed=fixed, noted=noted,
            old_flags=old_flags)})


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


@dataclass(frozen=True)
class Knob:
    """A knob as declared (`Section.knob`), with its field's name, type and default."""

    name: str
    kind: type  # int, float, str or bool
    optional: bool  # None allowed (it means: unset)
    default: Any
    section: Section
    help: str
    choices: tuple | None
    check: Callable[[str, Any], list[str]] | None
    flag: str | None
    metavar: str | None
    path: bool
    fixed: str | None
    noted: bool
    old_flags: tuple[str, ...]  # former spellings of `option` (deprecated aliases)

    @property
    def option(self) -> str:
        """Its command-line flag."""
        if self.flag:
            return self.flag
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.kind is bool and self.default else f"--{dashed}"

    def fits(self, value) -> bool:
        """Whether `value` is of this knob's type (an integer for a float: yes)."""
        if value is None:
            return self.optional
        if self.kind is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return isinstance(value, self.kind) and isinstance(value, bool) == (self.kind is bool)

    def typed(self, value):
        """`value` as this knob holds it: an integer given for a float knob, a float."""
        exact = self.kind is not float or value is None or not self.fits(value)
        return value if exact else float(value)

    def type_problem(self, value) -> str | None:
        """'name='five' is not an integer' when `value` is not of this knob's type."""
        if self.fits(value):
            return None
        return f"{self.name}={value!r} is not {_KINDS[self.kind]}"

    def problems(self, value) -> list[str]:
        """Why `value` cannot be this knob's: its type, choices, check (empty: it can)."""
        bad = self.type_problem(value)
        if bad or value is None:
            return [bad] if bad else []
        if self.choices is not None and value not in self.choices:
            return [f"{self.name}={value!r} is not one of {self.choices}"]
        return self.check(self.name, value) if self.check else []


@cache
def knobs(cls: type) -> tuple[Knob, ...]:
    """The knobs of a dataclass of `Section.knob` fields, in their order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        if KNOB not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with Section.knob")
        kind, optional = _kind(hints[f.name])
        default = f.default if f.default is not MISSING else None
        out.append(Knob(f.name, kind, optional, default, **f.metadata[KNOB]))
    return tuple(out)


def _kind(hint) -> tuple[type, bool]:
    """int | None -> (int, True); float -> (float, False)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def sections(cls: type) -> dict[str, tuple[Knob, ...]]:
    """Section name -> its knobs, the sections in the order their first knob comes."""
    out: dict[str, list[Knob]] = {}
    for k in knobs(cls):
        out.setdefault(k.section.name, []).append(k)
    return {name: tuple(ks) for name, ks in out.items()}


def knob_problems(cfg) -> list[str]:
    """Every knob of `cfg` whose value is not of its type, choices or check."""
    return [p for k in knobs(type(cfg)) for p in k.problems(getattr(cfg, k.name))]
