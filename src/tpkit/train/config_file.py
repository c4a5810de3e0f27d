"""A run's configuration as a file people keep: sectioned TOML, read and written.

    [model]            preset = "llama-tiny"          (or from_hf = "path/to/hf-folder")
    [parallelism]      tp = 2   pp = 2   schedule = "1f1b"
    [training]         steps = 200   global_batch = 16   seq = 128
    [optimizer]        lr = 3e-3   warmup = 10
    [data]             data = "data/corpus"
    [checkpoint]       ckpt_every = 50
    [logging]          out = "runs/llama"   log = "tensorboard"
    [reliability]      collective_timeout = 300.0

Every key is a `TrainConfig` field (dashes allowed), in its section or at the top level
(the flat files of earlier versions still read). An unknown key or section, or a key
in the wrong section, is one error naming it and the nearest valid one. A run keeps
the file of what it ran (`config.toml` in its folder, written atomically), and a
resumed run names what changed since (`resume_changes`), refusing what cannot work.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from tpkit.spec.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# A tpkit.train.config.TrainConfig: not imported, since config imports this module (read
# through dataclasses.fields, so any dataclass of the same fields would do).
TrainConfig = Any

RUN_CONFIG = "config.toml"  # in the run folder: what it ran
SECTIONS: dict[str, tuple[str, ...]] = {  # section -> its TrainConfig fields, in this order
    "model": ("preset", "from_hf", "dtype", "master_weights", "recompute", "compile",
              "compile_backend", "loss_chunk"),
    "parallelism": ("tp", "pp", "dp", "sp", "zero1", "zero2", "fsdp", "fsdp_reshard", "cp", "schedule",
                    "virtual_stages"),
    "training": ("steps", "micro_batches", "global_batch", "seq", "seed"),
    "optimizer": ("lr", "min_lr", "warmup", "weight_decay", "beta2", "clip"),
    "data": ("data", "val_fraction", "eval_every", "eval_batches"),
    "checkpoint": ("ckpt_every", "keep_checkpoints", "resume", "checkpoint"),
    "logging": ("out", "log", "trace", "progress", "plot"),
    "reliability": ("check_replicas", "collective_timeout", "on_nonfinite", "nonfinite_skips"),
}
FALLBACK = "training"  # a field no section lists (tests/test_config_file.py says which)
# what a resumed run may not change, and why
FIXED_ON_RESUME = {
    "preset": "another model", "from_hf": "another model",
    "seq": "the data loader's windows", "seed": "the data loader's order",
    "data": "the data loader's position", "val_fraction": "the data loader's windows",
}


def section_of(name: str) -> str:
    """The section a field belongs to."""
    return next((s for s, names in SECTIONS.items() if name in names), FALLBACK)


def nearest(word: str, options, shape: str = "'{}'") -> str:
    """'; did you mean X?' for the closest of `options`, or ''."""
    close = difflib.get_close_matches(word, sorted(options), n=1, cutoff=0.5)
    return f"; did you mean {shape.format(close[0])}?" if close else ""


def read_toml(path: str | Path, known: set[str]) -> dict:
    """The flat {field: value} of a TOML file, sectioned or flat; one error for a bad key."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {p} does not exist")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e})") from None
    out: dict = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            items = [(k, v, key) for k, v in value.items()]
            if key not in SECTIONS:
                raise UserError(f"{p}: unknown section [{key}]{nearest(key, SECTIONS, '[{}]')} "
                                f"(sections: {', '.join(SECTIONS)})")
        else:
            items = [(key, value, None)]
        for k, v, section in items:
            _put(out, p, k.replace("-", "_"), v, section, known)
    return out


def _put(out: dict, p: Path, name: str, value, section: str | None, known: set[str]) -> None:
    where = f"[{section}] " if section else ""
    if name not in known:
        raise UserError(f"{p}: unknown key {where}{name!r}{nearest(name, known)}")
    if section is not None and section_of(name) != section:
        raise UserError(f"{p}: {name!r} belongs in [{section_of(name)}], not [{section}]")
    if name in out:
        raise UserError(f"{p}: {name!r} is given twice")
    out[name] = value


def _value(v) -> str:
    """A TOML scalar (strings as JSON strings, which TOML reads alike)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def to_toml(cfg: TrainConfig, header: str = "") -> str:
    """The config as sectioned TOML (an unset field as a comment); `read_toml` reads it
    back to the same config."""
    values = cfg.to_dict()
    lines = [f"# {line}" for line in header.splitlines()]
    sections = {s: [] for s in SECTIONS}
    for f in fields(cfg):
        sections.setdefault(section_of(f.name), []).append(f.name)
    for section, names in sections.items():
        lines += ["" if lines else None, f"[{section}]"]
        lines += [f"{n} = {_value(values[n])}" if values[n] is not None else f"# {n} = (unset)"
                  for n in names]
    return "\n".join(line for line in lines if line is not None) + "\n"


def write_run_config(cfg: TrainConfig, folder: str | Path) -> Path:
    """`folder/config.toml` of what this run runs, written whole or not at all."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path, tmp = folder / RUN_CONFIG, folder / f".{RUN_CONFIG}.tmp"
    tmp.write_text(to_toml(cfg, "the configuration this run ran with (tpkit train "
                                "--config reads it back)"))
    os.replace(tmp, path)
    return path


def resume_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """'key: old -> new' for every field that differs from the `saved` config (resume and
    output flags aside); a change in FIXED_ON_RESUME is one UserError naming it."""
    now = cfg.to_dict()
    changed = [k for k in now if k in saved and saved[k] != now[k]
               and k not in ("resume", "progress", "plot")]
    for k in changed:
        if k in FIXED_ON_RESUME and not _same_path(k, saved[k], now[k]):
            raise UserError(f"--resume: the checkpoint was trained with {k}={saved[k]!r}, this "
                            f"run has {k}={now[k]!r}; {FIXED_ON_RESUME[k]} cannot continue it "
                            f"(start a new run with --out elsewhere)")
    return [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed
            if not (k in FIXED_ON_RESUME and _same_path(k, saved[k], now[k]))]


def _same_path(key: str, old, new) -> bool:
    """from_hf and data written another way (./x and x) are the same."""
    if key not in ("from_hf", "data") or old is None or new is None:
        return False
    return Path(old).resolve() == Path(new).resolve()


def saved_config(checkpoint: str | Path) -> dict | None:
    """The TrainConfig a checkpoint was written with (its manifest), or None."""
    from tpkit.checkpoint.files import MANIFEST

    path = Path(checkpoint) / MANIFEST
    try:
        config = json.loads(path.read_text()).get("extra", {}).get("config")
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
