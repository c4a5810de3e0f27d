"""One declaration per knob: a field of a config dataclass (`tpkit train`'s
`TrainConfig`, `tpkit serve`'s and `tpkit generate`'s `ServeConfig`) made by
`Section.knob`, with its default, help, choices, checks and resume rule; its type is
the field's annotation (int, float, str, bool, `X | None`, or `tuple[str, ...]`: a
repeatable flag). Everything else is generated from the declarations:

    OPTIMIZER = Section("optimizer", "AdamW and its learning rate")
    warmup: int = OPTIMIZER.knob(10, "warmup steps", check=COUNT)     # in TrainConfig

    tpkit train --help                   optimizer:   --warmup N  warmup steps (default: 10)
    [optimizer] warmup = 10              its key in a file (`tpkit.train.config_file`)
    warmup=-1 must be an integer >= 0    its check (`TrainConfig.problems`, exit 2)

A bool knob is a flag: --name when its default is False, --no-name when True. The flags
are `tpkit.commands.common.add_knobs`'; pure Python, at the bottom of the layers, so that
every command can declare its knobs here.
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
    """A group of knobs: one TOML section, one heading of the command's --help (two
    sections of one name share their heading)."""

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
    many: bool = False  # a tuple of `kind`s: a repeatable flag

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
        if self.many:
            return isinstance(value, tuple) and all(map(self._fits_one, value))
        return self._fits_one(value)

    def _fits_one(self, value) -> bool:
        if self.kind is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return isinstance(value, self.kind) and isinstance(value, bool) == (self.kind is bool)

    def typed(self, value):
        """`value` as this knob holds it: an integer given for a float knob, a float."""
        exact = self.kind is not float or self.many or value is None or not self.fits(value)
        return value if exact else float(value)

    def type_problem(self, value, name: str | None = None) -> str | None:
        """'name='five' is not an integer' when `value` is not of this knob's type
        (`name`: how to call it, default its field's name)."""
        if self.fits(value):
            return None
        kind = _KINDS[self.kind] + (" each" if self.many else "")
        return f"{name or self.name}={value!r} is not {kind}"

    def problems(self, value, name: str | None = None) -> list[str]:
        """Why `value` cannot be this knob's: its type, choices, check (empty: it can).
        `name`: how the lines call it (default: its field's name; a command: its flag)."""
        name = name or self.name
        bad = self.type_problem(value, name)
        if bad or value is None:
            return [bad] if bad else []
        if self.choices is not None and value not in self.choices:
            return [f"{name}={value!r} is not one of {self.choices}"]
        return self.check(name, value) if self.check else []


@cache
def knobs(cls: type) -> tuple[Knob, ...]:
    """The knobs of a dataclass of `Section.knob` fields, in their order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        if KNOB not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with Section.knob")
        kind, optional, many = _kind(hints[f.name])
        default = f.default if f.default is not MISSING else None
        out.append(Knob(f.name, kind, optional, default, **f.metadata[KNOB], many=many))
    return tuple(out)


def _kind(hint) -> tuple[type, bool, bool]:
    """int | None -> (int, True, False); float -> (float, False, False); tuple[str, ...]
    -> (str, False, True)."""
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], False, True
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:
        return args[0], len(args) < len(typing.get_args(hint)), False
    return hint, False, False


def sections(cls: type) -> dict[str, tuple[Knob, ...]]:
    """Section name -> its knobs, the sections in the order their first knob comes."""
    out: dict[str, list[Knob]] = {}
    for k in knobs(cls):
        out.setdefault(k.section.name, []).append(k)
    return {name: tuple(ks) for name, ks in out.items()}


def knob_problems(cfg) -> list[str]:
    """Every knob of `cfg` whose value is not of its type, choices or check."""
    return [p for k in knobs(type(cfg)) for p in k.problems(getattr(cfg, k.name))]
