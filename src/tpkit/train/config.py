"""`TrainConfig`: every knob of `tpkit train`, from flags or a TOML file, validated early.

Validation runs on every rank before any collective (and in the launcher before
any process starts), each error naming the numbers:

    global_batch=10 is not divisible by dp*micro_batches = 2*4 = 8
    gpt2-tiny: pp=5 stages is more than num_layers=4
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from pathlib import Path

from tpkit.comm.failure import DEFAULT_COLLECTIVE_TIMEOUT_S
from tpkit.spec.errors import UserError
from tpkit.spec.shapes import chunks_problem, interleave_problem

DTYPES = ("float32", "bfloat16")
NONFINITE_POLICIES = ("stop", "skip")  # what a NaN/inf step does (tpkit.train.nonfinite)


@dataclass(frozen=True)
class TrainConfig:
    """A training run: model, layout, batch, optimizer, data, outputs."""

    preset: str = "gpt2-tiny"
    from_hf: str | None = None  # a Hugging Face model folder to fine-tune (instead of preset)
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
    zero2: bool = False  # gradients and AdamW state sharded over dp (tpkit.parallel.zero2)
    fsdp: bool = False  # weights too, one flat unit per layer (tpkit.parallel.fsdp)
    fsdp_reshard: str = "after-forward"  # or after-step: keep gathered weights for the step
    cp: int = 1  # context parallel: each sequence over cp ranks, ring attention
    schedule: str = "1f1b"  # a key of tpkit.parallel.schedules.SCHEDULES
    virtual_stages: int = 1  # model chunks per stage (interleaved 1F1B)
    dtype: str = "float32"  # bfloat16: autocast of the forward
    recompute: bool = False
    master_weights: bool = False  # with dtype bfloat16: bf16 model, fp32 masters (train/master)
    compile: bool = False  # torch.compile each transformer block (collectives: graph breaks)
    compile_backend: str = "inductor"
    loss_chunk: int = 0  # > 0: head + cross-entropy this many tokens at a time (chunked loss)
    data: str | None = None  # None: the embedded corpus (Python's own documentation)
    val_fraction: float = 0.05
    eval_every: int = 50
    eval_batches: int = 2
    ckpt_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 3  # newest complete checkpoints kept in out/checkpoints (0: all)
    check_replicas: int = 0  # every N steps: replicated parameters equal on every tp rank
    out: str = "runs/train"
    log: str = "auto"  # trackers: tensorboard,wandb,mlflow,trackio | none | auto (train/trackers)
    seed: int = 0
    trace: str | None = None  # a folder: the last step's per-rank timeline (tpkit.train.trace)
    resume: str | None = None  # a checkpoint directory (`tpkit train` resolves a run folder, "auto")
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S  # s a collective may wait
    on_nonfinite: str = "stop"  # a NaN/inf loss or grad norm: stop the run, or skip the step
    nonfinite_skips: int = 3  # with on_nonfinite="skip": stop after this many in a row
    progress: bool = True
    plot: bool = True
    checkpoint: bool = True

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch on one replica."""
        return self.global_batch // (self.dp * self.micro_batches)

    @property
    def world_size(self) -> int:
        """tp * pp * dp * cp."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def model_name(self) -> str:
        """What is trained: the preset, or the Hugging Face folder."""
        return self.from_hf or self.preset

    def model_config(self):
        """The model's `ModelConfig`: the preset's, or the Hugging Face folder's (its
        config.json read once per TrainConfig: the value travels with it to the ranks)."""
        return self._model_config

    @cached_property
    def _model_config(self):
        from tpkit.spec.config import get_preset

        if self.from_hf is None:
            return get_preset(self.preset)
        import json

        from tpkit.checkpoint.families import config_from_hf

        path = Path(self.from_hf) / "config.json"
        if not path.is_file():
            raise UserError(f"from_hf={self.from_hf}: no config.json there (not a Hugging "
                            f"Face model folder)")
        return config_from_hf(json.loads(path.read_text()))[1]

    @property
    def tokenizer_id(self) -> str | None:
        """The model's tokenizer, as `prepare-data --tokenizer` names one: the Hugging Face
        folder, "bytes" for a byte-level preset (vocab 256), None when unknown."""
        if self.from_hf is not None:
            return self.from_hf
        return "bytes" if self.model_config().vocab_size == 256 else None

    def with_(self, **changes) -> TrainConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain dict (for metrics and manifests)."""
        return asdict(self)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides) -> TrainConfig:
        """Read a TOML file, sectioned ([model], [parallelism], ...) or flat, whose keys are
        the field names (dashes allowed), then override (`tpkit.train.config_file`)."""
        from tpkit.train.config_file import read_toml

        return cls(**{**read_toml(path, {f.name for f in fields(cls)}), **overrides})

    def problems(self) -> list[str]:
        """Every reason this run cannot start; empty when it can."""
        out = [f"{k}={getattr(self, k)} must be a positive integer"
               for k in ("tp", "pp", "dp", "steps", "micro_batches", "global_batch", "seq",
                         "virtual_stages", "cp")
               if not isinstance(getattr(self, k), int) or getattr(self, k) < 1]
        out += [f"{k}={getattr(self, k)} must be an integer >= 0"
                for k in ("warmup", "ckpt_every", "keep_checkpoints", "check_replicas",
                          "eval_every", "eval_batches")
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
        out += self._sharding_problems()
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            out.append(f"loss_chunk={self.loss_chunk} must be 0 (off) or a positive number "
                       f"of tokens")
        if self.master_weights and self.dtype != "bfloat16":
            out.append(f"master_weights needs dtype='bfloat16' (bf16 weights with fp32 "
                       f"masters), not {self.dtype!r}")
        if self.compile:
            out += _backend_problems(self.compile_backend)
        if self.on_nonfinite not in NONFINITE_POLICIES:
            out.append(f"on_nonfinite={self.on_nonfinite!r} is not one of "
                       f"{NONFINITE_POLICIES}")
        if not isinstance(self.nonfinite_skips, int) or self.nonfinite_skips < 1:
            out.append(f"nonfinite_skips={self.nonfinite_skips} must be a positive integer")
        if self.dtype not in DTYPES:
            out.append(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if not 0.0 <= self.val_fraction < 1.0:
            out.append(f"val_fraction={self.val_fraction} must be in [0, 1)")
        if not 0 < self.lr < 1e30:  # AdamW's step lr / (1 - beta1^t) must stay a float32
            out.append(f"lr={self.lr} must be positive and below 1e30")
        out += _tracker_problems(self.log)
        try:
            model = self.model_config()
        except ValueError as e:
            return out + [str(e)]
        said = model.problem_line(tp=self.tp, pp=self.pp, sp=self.sp, seq=self.seq)
        out += [said] if said else []
        out += self._from_hf_problems()
        out += self._context_problems(model)
        chunks = chunks_problem(model.num_layers, self.pp, self.virtual_stages)
        if self.virtual_stages > 1 and chunks:  # at v=1, model.problems says pp > layers
            out.append(f"{model.name}: {chunks}")
        return out

    def _from_hf_problems(self) -> list[str]:
        from tpkit.train.tokens import INDEX

        if self.from_hf is None or (self.data and (Path(self.data) / INDEX).is_file()):
            return []
        return [f"from_hf={self.from_hf} trains on ids of its own tokenizer, but data="
                f"{self.data} would be read as bytes: run `tpkit prepare-data TEXT_FILES "
                f"--tokenizer {self.from_hf} --out DIR` and train on data=DIR"]

    def _context_problems(self, model) -> list[str]:
        """What context parallelism (cp > 1) cannot run yet, each naming the setting."""
        if self.cp == 1:
            return []
        out = [] if self.seq % (2 * self.cp) == 0 else [
            f"seq={self.seq} is not divisible by 2*cp = {2 * self.cp} (context parallelism "
            f"cuts each sequence into 2 cp chunks)"]
        bad = [("dropout", model.dropout > 0,
               f"dropout={model.dropout}"), ("causal", not model.causal, "a bidirectional "
               "model"), ("sliding_window", bool(model.sliding_window), "a sliding window")]
        return out + [f"cp={self.cp} with {what} is not supported yet" for _, on, what in bad
                      if on]

    def _sharding_problems(self) -> list[str]:
        from tpkit.spec.theory import FSDP_RESHARD

        chosen = [k for k in ("zero1", "zero2", "fsdp") if getattr(self, k)]
        out = [f"choose one of {' / '.join(chosen)} (each shards more than the one before)"] \
            if len(chosen) > 1 else []
        if self.fsdp_reshard not in FSDP_RESHARD:
            out.append(f"fsdp_reshard={self.fsdp_reshard!r} is not one of {FSDP_RESHARD}")
        sharded = "fsdp" if self.fsdp else "zero2" if self.zero2 else None
        if sharded and self.master_weights:
            out.append(f"{sharded} with master_weights is not supported: the shards are the "
                       f"fp32 masters; train with dtype='bfloat16' (autocast) instead")
        if self.fsdp:
            out += ["fsdp with compile is not supported yet"] if self.compile else []
            if self.loss_chunk:
                out.append("fsdp with loss_chunk is not supported yet")
        return out

    def _schedule_problems(self) -> list[str]:
        from tpkit.parallel.schedules import CHUNKED, schedule_problems

        problems = schedule_problems(self.schedule, self.virtual_stages)
        if problems or self.schedule != CHUNKED:
            return problems
        problem = interleave_problem(self.micro_batches, self.pp)
        return [problem] if problem else []

    def check(self, world_size: int | None = None) -> None:
        """Raise UserError listing every problem (and a world-size mismatch)."""
        problems = self.problems()
        if world_size is not None and world_size != self.world_size:
            problems.append(f"tp*pp*dp*cp = {self.tp}*{self.pp}*{self.dp}*{self.cp} = "
                            f"{self.world_size} does not equal the number of processes "
                            f"{world_size}")
        if problems:
            raise UserError("; ".join(problems))


def _tracker_problems(log: str) -> list[str]:
    from tpkit.train.trackers import problems

    return problems(log)


def _backend_problems(backend: str) -> list[str]:
    """torch.compile's backends, checked before any process starts."""
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    return [] if backend in known else [f"compile_backend={backend!r} is not one of {known}"]
