"""`TrainConfig`: every knob of `tpkit train`, from flags or a TOML file, validated early.

Validation runs on every rank before any collective (and in the launcher before
any process starts), each error naming the numbers:

    global_batch=10 is not divisible by dp*micro_batches = 2*4 = 8
    gpt2-tiny: pp=5 stages is more than num_layers=4
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from tpkit.launch import DEFAULT_COLLECTIVE_TIMEOUT_S
from tpkit.spec.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTYPES = ("float32", "bfloat16")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class TrainConfig:
    """A training run: model, layout, batch, optimizer, data, outputs."""

    preset: str = "gpt2-tiny"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    steps: int = 100
    micro_batches: int = 1  # per step and dp replica (pipeline micro-batches / accumulation)
    global_batch: int = 8  # sequences per step, all replicas together
    seq: int = 64
    lr: float = 3e-3
    min_lr: float | None = None  # None: lr / 10
    warmup: int = 10
    weight_decay: float = 0.1
    beta2: float = 0.95
    clip: float = 1.0  # 0: no clipping
    sp: bool = False  # sequence parallelism
    zero1: bool = False
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    virtual_stages: int = 1  # model chunks per stage (interleaved 1F1B)
    dtype: str = "float32"  # bfloat16: autocast of the forward
    recompute: bool = False
    data: str | None = None  # None: the embedded corpus (Python's own documentation)
    val_fraction: float = 0.05
    eval_every: int = 50
    eval_batches: int = 2
    ckpt_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 3  # newest complete checkpoints kept in out/checkpoints (0: all)
    check_replicas: int = 0  # every N steps: replicated parameters equal on every tp rank
    log_every: int = 1
    out: str = "runs/train"
    seed: int = 0
    resume: str | None = None  # a checkpoint directory, or a folder of them (the latest)
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S  # s a collective may wait
    progress: bool = True
    plot: bool = True
    checkpoint: bool = True

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch on one replica."""
        return self.global_batch // (self.dp * self.micro_batches)

    @property
    def world_size(self) -> int:
        """tp * pp * dp."""
        return self.tp * self.pp * self.dp

    def with_(self, **changes) -> TrainConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain dict (for metrics and manifests)."""
        return asdict(self)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides) -> TrainConfig:
        """Read a TOML file whose keys are the field names (dashes allowed), then override."""
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {p} does not exist")
        raw = {k.replace("-", "_"): v for k, v in tomllib.loads(p.read_text()).items()}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise UserError(f"{p}: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**{**raw, **overrides})

    def problems(self) -> list[str]:
        """Every reason this run cannot start; empty when it can."""
        from tpkit.spec.config import get_preset

        out = [f"{k}={getattr(self, k)} must be a positive integer"
               for k in ("tp", "pp", "dp", "steps", "micro_batches", "global_batch", "seq",
                         "virtual_stages")
               if not isinstance(getattr(self, k), int) or getattr(self, k) < 1]
        out += [f"{k}={getattr(self, k)} must be an integer >= 0"
                for k in ("warmup", "ckpt_every", "keep_checkpoints", "check_replicas",
                          "eval_every", "eval_batches", "log_every")
                if not isinstance(getattr(self, k), int) or getattr(self, k) < 0]
        out += [f"{k}={getattr(self, k)} must be a number >= 0"
                for k in ("clip", "weight_decay", "min_lr")
                if getattr(self, k) is not None and not getattr(self, k) >= 0]
        if not self.collective_timeout > 0:
            out.append(f"collective_timeout={self.collective_timeout} must be a positive "
                       f"number of seconds")
        if out:
            return out
        if self.global_batch % (self.dp * self.micro_batches):
            out.append(f"global_batch={self.global_batch} is not divisible by dp*micro_batches "
                       f"= {self.dp}*{self.micro_batches} = {self.dp * self.micro_batches}")
        out += self._schedule_problems()
        if self.dtype not in DTYPES:
            out.append(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if not 0.0 <= self.val_fraction < 1.0:
            out.append(f"val_fraction={self.val_fraction} must be in [0, 1)")
        if not self.lr > 0:
            out.append(f"lr={self.lr} must be positive")
        try:
            model = get_preset(self.preset)
        except ValueError as e:
            return out + [str(e)]
        out += [f"{model.name}: {p}" for p in
                model.problems(tp=self.tp, pp=self.pp, sp=self.sp, seq=self.seq)]
        chunks = self.pp * self.virtual_stages
        if self.virtual_stages > 1 and chunks > model.num_layers:
            out.append(f"{model.name}: pp*virtual_stages = {self.pp}*{self.virtual_stages} = "
                       f"{chunks} chunks is more than num_layers={model.num_layers}")
        return out

    def _schedule_problems(self) -> list[str]:
        if self.schedule not in SCHEDULES:
            return [f"schedule={self.schedule!r} is not one of {SCHEDULES}"]
        if self.schedule != "interleaved":
            return [f"virtual_stages={self.virtual_stages} needs schedule='interleaved', not "
                    f"{self.schedule!r}"] if self.virtual_stages > 1 else []
        if self.micro_batches % self.pp:
            return [f"micro_batches={self.micro_batches} is not a multiple of pp={self.pp} "
                    f"(interleaved 1F1B)"]
        return []

    def check(self, world_size: int | None = None) -> None:
        """Raise UserError listing every problem (and a world-size mismatch)."""
        problems = self.problems()
        if world_size is not None and world_size != self.world_size:
            problems.append(f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world_size} "
                            f"does not equal the number of processes {world_size}")
        if problems:
            raise UserError("; ".join(problems))
