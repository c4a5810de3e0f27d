"""A run's configuration as a file people keep: sectioned TOML, read and written.

    [model]            preset = "llama-tiny"          (or from_hf = "path/to/hf-folder")
    [parallelism]      tp = 2   pp = 2   schedule = "1f1b"
    [training]         steps = 200   global_batch = 16   seq = 128
    [optimizer]        lr = 3e-3   warmup = 10
    [data]             data = "data/corpus"
    [checkpoint]       ckpt_every = 50
    [logging]          out = "runs/llama"   log = "tensorboard"
    [reliability]      collective_timeout = 300.0

Every key is a knob of `TrainConfig` (`tpkit.spec.knobs`: its section, type and
resume rule are declared with it), dashes allowed, in its section or at the top level
(the flat files of earlier versions still read). An unknown key or section, a key in
the wrong section or a value of the wrong type is one error naming it (and the nearest
valid one). A run keeps the file of what it ran (`config.toml` in its folder, written
atomically), and a resumed run names what changed since (`resume_changes`), refusing
what cannot work.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from pathlib import Path

from tpkit.spec.errors import UserError
from tpkit.spec.knobs import Knob, knobs, sections
from tpkit.weights.files import MANIFEST

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RUN_CONFIG = "config.toml"  # in the run folder: what it ran


def nearest(word: str, options, shape: str = "'{}'") -> str:
    """'; did you mean X?' for the closest of `options`, or ''."""
    close = difflib.get_close_matches(word, sorted(options), n=1, cutoff=0.5)
    return f"; did you mean {shape.format(close[0])}?" if close else ""


def read_toml(path: str | Path, cls: type) -> dict:
    """The flat {field: value} of a TOML file of `cls`'s knobs (TrainConfig), sectioned or
    flat, each value of its knob's type; one error for a bad key, section or value."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {p} does not exist")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e})") from None
    known, names = {k.name: k for k in knobs(cls)}, sections(cls)
    out: dict = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            items = [(k, v, key) for k, v in value.items()]
            if key not in names:
                raise UserError(f"{p}: unknown section [{key}]{nearest(key, names, '[{}]')} "
                                f"(sections: {', '.join(names)})")
        else:
            items = [(key, value, None)]
        for k, v, section in items:
            _put(out, p, k.replace("-", "_"), v, section, known)
    return out


def _put(out: dict, p: Path, name: str, value, section: str | None,
         known: dict[str, Knob]) -> None:
    where = f"[{section}] " if section else ""
    if name not in known:
        raise UserError(f"{p}: unknown key {where}{name!r}{nearest(name, known)}")
    knob = known[name]
    if section is not None and knob.section.name != section:
        raise UserError(f"{p}: {name!r} belongs in [{knob.section.name}], not [{section}]")
    if name in out:
        raise UserError(f"{p}: {name!r} is given twice")
    bad = knob.type_problem(value)
    if bad:
        raise UserError(f"{p}: {where}{bad}")
    out[name] = knob.typed(value)


def toml_value(v) -> str:
    """A TOML scalar (strings as JSON strings, which TOML reads alike)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def to_toml(cfg: object, header: str = "") -> str:
    """A config (TrainConfig: a dataclass of knobs) as sectioned TOML, an unset knob as a
    comment; `read_toml` reads it back to the same config."""
    lines = [f"# {line}" for line in header.splitlines()]
    for section, ks in sections(type(cfg)).items():
        lines += ["" if lines else None, f"[{section}]"]
        values = [(k.name, getattr(cfg, k.name)) for k in ks]
        lines += [f"{n} = {toml_value(v)}" if v is not None else f"# {n} = (unset)"
                  for n, v in values]
    return "\n".join(line for line in lines if line is not None) + "\n"


def write_run_config(cfg: object, folder: str | Path) -> Path:
    """`folder/config.toml` of what this run runs, written whole or not at all."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path, tmp = folder / RUN_CONFIG, folder / f".{RUN_CONFIG}.tmp"
    tmp.write_text(to_toml(cfg, "the configuration this run ran with (tpkit train "
                                "--config reads it back)"))
    os.replace(tmp, path)
    return path


def resume_changes(saved: dict, cfg: object) -> list[str]:
    """'key: old -> new' for every knob that differs from the `saved` config (those a
    resume does not note aside: resume and output flags); a change of a knob fixed on
    resume (another model, another data order) is one UserError naming it."""
    changed = [(k, saved[k.name], getattr(cfg, k.name)) for k in knobs(type(cfg))
               if k.noted and k.name in saved and not _same(k, saved[k.name],
                                                            getattr(cfg, k.name))]
    for k, old, new in changed:
        if k.fixed:
            raise UserError(f"--resume: the checkpoint was trained with {k.name}={old!r}, "
                            f"this run has {k.name}={new!r}; {k.fixed} cannot continue it "
                            f"(start a new run with --out elsewhere)")
    return [f"{k.name}: {old!r} -> {new!r}" for k, old, new in changed]


def _same(knob: Knob, old, new) -> bool:
    """Equal; for a path, written either way (./x and x)."""
    if old == new:
        return True
    if not knob.path or old is None or new is None:
        return False
    return Path(old).resolve() == Path(new).resolve()


def saved_config(checkpoint: str | Path) -> dict | None:
    """The TrainConfig a checkpoint was written with (its manifest), or None."""
    path = Path(checkpoint) / MANIFEST
    try:
        config = json.loads(path.read_text()).get("extra", {}).get("config")
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
