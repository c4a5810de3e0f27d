"""`TrainConfig`: every knob of `tpkit train`, from flags or a TOML file, validated early.

Validation runs on every rank before any collective (and in the launcher before
any process starts), each error naming the numbers:

    global_batch=10 is not divisible by dp*micro_batches = 2*4 = 8
    gpt2-tiny: pp=5 stages is more than num_layers=4
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

from tpkit.comm.failure import DEFAULT_COLLECTIVE_TIMEOUT_S
from tpkit.parallel.schedules import CHUNKED, SCHEDULES, schedule_problems
from tpkit.spec.config import LORA_TARGETS, get_preset
from tpkit.spec.errors import UserError
from tpkit.spec.grid import world_of
from tpkit.spec.knobs import (
    AT_LEAST_0,
    COUNT,
    POSITIVE_INT,
    Check,
    Section,
    knob_problems,
    sections,
)
from tpkit.spec.shapes import LOSS_CHUNK_SAYS, chunks_problem, interleave_problem, loss_chunk_ok
from tpkit.spec.theory import FSDP_RESHARD
from tpkit.train.config_file import read_toml
from tpkit.train.data import assistant_mask_problem, read_by_the_model
from tpkit.train.trackers import problems
from tpkit.weights.hf import hf_config

DTYPES = ("float32", "bfloat16")
LOSS_ON = ("all", "assistant")  # which tokens' predictions the loss is on
NONFINITE_POLICIES = ("stop", "skip")  # what a NaN/inf step does (tpkit.train.nonfinite)

MODEL = Section("model", "what is trained, and how it computes")
PARALLEL = Section("parallelism", "the layout: tp*pp*dp*cp processes")
TRAINING = Section("training", "steps and batch")
OPTIMIZER = Section("optimizer", "AdamW and its learning rate")
DATA = Section("data", "the text, and the validation held out of it")
CHECKPOINT = Section("checkpoint", "when checkpoints are written, how many are kept, resume")
LOGGING = Section("logging", "the run folder and what it records")
RELIABILITY = Section("reliability", "checks and failures")
ANOTHER_MODEL = "another model"


def _trackers_check(name: str, value: str) -> list[str]:
    return problems(value)


@dataclass(frozen=True)
class TrainConfig:
    """A training run: each field a knob (`tpkit.spec.knobs`), which is also its
    flag, TOML key and --help line, in its section."""

    preset: str = MODEL.knob("gpt2-tiny", "model preset (`tpkit presets` lists them)",
                             metavar="NAME", fixed=ANOTHER_MODEL)
    from_hf: str | None = MODEL.knob(
        None, "fine-tune a Hugging Face model folder (its config, weights; its tokenizer "
        "goes into the checkpoints) (default: none, the preset)", metavar="DIR", path=True,
        fixed=ANOTHER_MODEL)
    lora_rank: int = MODEL.knob(
        0, "train low-rank adapters of this rank (LoRA), the model's weights frozen and "
        "without optimizer state; at any tp, A and B split as their base weight (0: off, "
        "every weight trains)", check=COUNT, fixed=ANOTHER_MODEL)
    lora_alpha: float | None = MODEL.knob(
        None, "the adapters' output is scaled by lora_alpha / lora_rank (default: the rank, "
        "a scale of 1)", check=Check(lambda v: v > 0, "must be positive"), fixed=ANOTHER_MODEL)
    lora_targets: str = MODEL.knob(
        "q,k,v,o", "the linear layers adapted, comma-separated, of " + ",".join(LORA_TARGETS),
        metavar="LIST", check=Check(lambda v: bool(v) and set(v.split(",")) <= set(LORA_TARGETS),
                                    "must be a comma-separated list of " + ",".join(LORA_TARGETS)),
        fixed=ANOTHER_MODEL)
    dtype: str = MODEL.knob("float32", "compute dtype (bfloat16: autocast)", choices=DTYPES)
    master_weights: bool = MODEL.knob(
        False, "with --dtype bfloat16: bf16 weights and activations, fp32 master weights "
        "and gradient sums (Megatron's recipe)")
    recompute: bool = MODEL.knob(False, "recompute activations in backward")
    compile: bool = MODEL.knob(False, "torch.compile each transformer block (collectives "
                                      "stay eager, as graph breaks); prints the compile time")
    compile_backend: str = MODEL.knob("inductor", "torch.compile backend for --compile",
                                      metavar="NAME")
    loss_chunk: int = MODEL.knob(
        0, "head + cross-entropy this many tokens at a time: the logits of the whole "
        "micro-batch never exist (0: off)",
        check=Check(loss_chunk_ok, LOSS_CHUNK_SAYS))

    tp: int = PARALLEL.knob(1, "tensor-parallel size", check=POSITIVE_INT)
    pp: int = PARALLEL.knob(1, "pipeline stages", check=POSITIVE_INT)
    dp: int = PARALLEL.knob(1, "data-parallel replicas (default: what the processes leave "
                               "over)", check=POSITIVE_INT)
    sp: bool = PARALLEL.knob(False, "sequence parallelism")
    zero1: bool = PARALLEL.knob(False, "shard the optimizer state over dp (ZeRO-1)")
    zero2: bool = PARALLEL.knob(
        False, "shard the gradients and the optimizer state over dp, weights replicated "
        "(ZeRO-2): each micro-batch's gradients are reduce-scattered in buckets as "
        "backward finishes them")
    fsdp: bool = PARALLEL.knob(
        False, "fully sharded data parallel (ZeRO-3): weights, gradients and optimizer "
        "state sharded over dp, one flat unit per layer, all-gathered just before use "
        "(composes with --tp and --pp)")
    fsdp_reshard: str = PARALLEL.knob(
        "after-forward", "with --fsdp, when gathered weights are freed: after-forward "
        "(gathered again for backward) or after-step (kept for the step: one gather and "
        "one reduce-scatter per step)", choices=FSDP_RESHARD)
    cp: int = PARALLEL.knob(1, "context-parallel ranks per sequence: load-balanced chunks, "
                               "ring attention (k/v passed point-to-point); the processes "
                               "are tp*pp*dp*cp", check=POSITIVE_INT)
    schedule: str = PARALLEL.knob("1f1b", "pipeline schedule", choices=SCHEDULES)
    virtual_stages: int = PARALLEL.knob(
        1, "model chunks per stage, for --schedule interleaved", check=POSITIVE_INT)

    steps: int = TRAINING.knob(100, "optimizer steps", check=POSITIVE_INT)
    micro_batches: int = TRAINING.knob(  # pipeline micro-batches / gradient accumulation
        1, "micro-batches per step and replica (default: 1 at pp=1; with pipeline "
        "stages, up to 2 per stage that divide global_batch/dp)", check=POSITIVE_INT)
    global_batch: int = TRAINING.knob(8, "sequences per step, all replicas together",
                                      check=POSITIVE_INT)
    seq: int = TRAINING.knob(64, "sequence length", check=POSITIVE_INT,
                             fixed="the data loader's windows")
    seed: int = TRAINING.knob(0, "seed of weights and data order",
                              fixed="the data loader's order")

    lr: float = OPTIMIZER.knob(3e-3, "peak learning rate", check=Check(  # AdamW's step
        lambda v: 0 < v < 1e30, "must be positive and below 1e30"))  # lr/(1-beta1^t): float32
    min_lr: float | None = OPTIMIZER.knob(None, "final learning rate (default: lr/10)",
                                          check=AT_LEAST_0)
    warmup: int = OPTIMIZER.knob(10, "warmup steps", check=COUNT)
    weight_decay: float = OPTIMIZER.knob(0.1, "AdamW weight decay", check=AT_LEAST_0)
    beta2: float = OPTIMIZER.knob(0.95, "AdamW's beta2")
    clip: float = OPTIMIZER.knob(1.0, "clip the global gradient norm to this (0: off)",
                                 check=AT_LEAST_0)

    data: str | None = DATA.knob(
        None, "UTF-8 text file, directory of .txt, .bin of uint16 tokens, a `tpkit "
        "prepare-data` folder, or .jsonl / .parquet / a datasets folder (tokenized as "
        "prepare-data does) (default: Python's own documentation, embedded)",
        metavar="PATH", path=True, fixed="the data loader's position")
    val_fraction: float = DATA.knob(0.05, "held-out fraction of the data", check=Check(
        lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"), fixed="the data loader's windows")
    loss_on: str = DATA.knob(
        "all", "the tokens the loss is on: all, or assistant (chat data prepared with "
        "--chat-field: the assistant's turns only, as TRL's assistant_only_loss)",
        choices=LOSS_ON)
    eval_every: int = DATA.knob(50, "validation every N steps", check=COUNT)
    eval_batches: int = DATA.knob(2, "batches per validation", check=COUNT)

    ckpt_every: int = CHECKPOINT.knob(
        500, "checkpoint every N steps, as torchtitan does, or sooner by --ckpt-minutes, "
        "whichever comes first; always at the end and at a SIGINT/SIGTERM's step "
        "boundary (0: not by steps; with --ckpt-minutes 0 too: only at the end)",
        check=COUNT)
    ckpt_minutes: float = CHECKPOINT.knob(
        10.0, "also checkpoint at the first step boundary this many minutes after the "
        "last checkpoint (or the start), rank 0's clock deciding for every rank: a slow "
        "machine loses at most this much work (0: not by time)", check=AT_LEAST_0)
    keep_checkpoints: int = CHECKPOINT.knob(
        3, "newest complete checkpoints of this run to keep (0: all): a long run holds "
        "at most this many, plus the one being written", check=COUNT)
    resume: str | None = CHECKPOINT.knob(  # `tpkit train` resolves it to a checkpoint folder
        None, "continue from a checkpoint, or a run folder (its latest valid one); auto: "
        "from the newest valid checkpoint in --out if there is one (restarts) (default: "
        "none, a new run)", metavar="PATH", path=True, noted=False)
    checkpoint: bool = CHECKPOINT.knob(
        True, "no checkpoint at all: not at the end, not by steps or minutes, not at a stop "
        "signal (with a --ckpt-every other than its default: only those)")

    out: str = LOGGING.knob("runs/train", "the run folder (config.toml, metrics.jsonl, "
                                          "loss.png, checkpoints/, tb/)", metavar="DIR",
                            path=True)
    log: str = LOGGING.knob(
        "auto", "experiment trackers, comma-separated: tensorboard, wandb, mlflow, trackio "
        "(offline, under --out), or none; auto: tensorboard when it is installed (the key "
        "log of a --config file)", flag="--trackers", metavar="LIST", check=_trackers_check,
        old_flags=("--log",))
    trace: str | None = LOGGING.knob(
        None, "write the last step's per-rank timeline here: trace.json (Perfetto / "
        "chrome://tracing) and step.png (also copied into the run folder) (default: none)",
        metavar="DIR", path=True)
    progress: bool = LOGGING.knob(True, "no progress bar", noted=False)
    plot: bool = LOGGING.knob(True, "no loss.png", noted=False)

    check_replicas: int = RELIABILITY.knob(
        0, "every N steps, check that replicated parameters are identical on every tp rank "
        "(0: off)", check=COUNT)
    collective_timeout: float = RELIABILITY.knob(
        DEFAULT_COLLECTIVE_TIMEOUT_S, "seconds a collective may wait for a dead or stuck "
        "rank before the run stops, naming it",
        check=Check(lambda v: v > 0, "must be a positive number of seconds"))
    on_nonfinite: str = RELIABILITY.knob(
        "stop", "a NaN/inf loss or gradient norm: stop the run (exit 1, naming the step) or "
        "skip the step's update", choices=NONFINITE_POLICIES)
    nonfinite_skips: int = RELIABILITY.knob(
        3, "with --on-nonfinite skip: stop after this many non-finite steps in a row",
        check=POSITIVE_INT)

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch on one replica."""
        return self.global_batch // (self.dp * self.micro_batches)

    @property
    def world_size(self) -> int:
        """tp * pp * dp * cp."""
        return world_of(self.tp, self.pp, self.dp, self.cp)

    @property
    def model_name(self) -> str:
        """What is trained: the preset, or the Hugging Face folder."""
        return self.from_hf or self.preset

    def model_config(self):
        """The model's `ModelConfig`: the preset's, or the Hugging Face folder's (its
        config.json and tensor names read once per TrainConfig, by `tpkit.weights.hf`, the
        reader every load uses: the value travels with it to the ranks)."""
        return self._model_config

    @cached_property
    def _model_config(self):
        if self.from_hf is None:
            return self.adapted(get_preset(self.preset))
        try:
            return self.adapted(hf_config(self.from_hf))
        except UserError as e:  # no config.json, an unsupported family, missing weights
            raise UserError(f"from_hf={self.from_hf}: {e}") from e

    def adapted(self, model):
        """`model` with the LoRA adapters asked for (none: as it is)."""
        if not self.lora_rank:
            return model
        return replace(model, lora_rank=self.lora_rank, lora_targets=tuple(
            self.lora_targets.split(",")), lora_alpha=float(self.lora_alpha or self.lora_rank))

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
        return cls(**{**read_toml(path, cls), **overrides})

    def problems(self) -> list[str]:
        """Every reason this run cannot start; empty when it can."""
        out = knob_problems(self)  # each value: its type, choices and check
        if out:
            return out
        if self.global_batch % (self.dp * self.micro_batches):
            out.append(f"global_batch={self.global_batch} is not divisible by dp*micro_batches "
                       f"= {self.dp}*{self.micro_batches} = {self.dp * self.micro_batches}")
        out += self._schedule_problems()
        out += self._sharding_problems()
        if self.master_weights and self.dtype != "bfloat16":
            out.append(f"master_weights needs dtype='bfloat16' (bf16 weights with fp32 "
                       f"masters), not {self.dtype!r}")
        if self.compile:
            out += _backend_problems(self.compile_backend)
        try:
            model = self.model_config()
        except ValueError as e:
            return out + [str(e)]
        said = model.problem_line(tp=self.tp, pp=self.pp, sp=self.sp, seq=self.seq)
        out += [said] if said else []
        out += self._from_hf_problems()
        said = assistant_mask_problem(self.data) if self.loss_on == "assistant" else None
        out += [said] if said else []
        out += self._context_problems(model)
        chunks = chunks_problem(model.num_layers, self.pp, self.virtual_stages)
        if self.virtual_stages > 1 and chunks:  # at v=1, model.problems says pp > layers
            out.append(f"{model.name}: {chunks}")
        return out

    def _from_hf_problems(self) -> list[str]:
        if self.from_hf is None or read_by_the_model(self.data):
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
        chosen = [k for k in ("zero1", "zero2", "fsdp") if getattr(self, k)]
        out = [f"choose one of {' / '.join(chosen)} (each shards more than the one before)"] \
            if len(chosen) > 1 else []
        sharded = "fsdp" if self.fsdp else "zero2" if self.zero2 else None
        if sharded and self.lora_rank:
            out.append(f"{sharded} with lora_rank is not supported: the adapters are small, "
                       f"train them with plain data parallelism or --zero1")
        if sharded and self.master_weights:
            out.append(f"{sharded} with master_weights is not supported: the shards are the "
                       f"fp32 masters; train with dtype='bfloat16' (autocast) instead")
        if self.fsdp:
            out += ["fsdp with compile is not supported yet"] if self.compile else []
            if self.loss_chunk:
                out.append("fsdp with loss_chunk is not supported yet")
        return out

    def _schedule_problems(self) -> list[str]:
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


def _backend_problems(backend: str) -> list[str]:
    """torch.compile's backends, checked before any process starts."""
    from torch._dynamo import list_backends  # lazy: Dynamo doubles a command's start

    known = list_backends(exclude_tags=())
    return [] if backend in known else [f"compile_backend={backend!r} is not one of {known}"]


SECTIONS = {name: tuple(k.name for k in ks) for name, ks in sections(TrainConfig).items()}
