"""Experiment tracking: each step's metrics into TensorBoard, Weights & Biases, MLflow or
trackio, through their own libraries, on rank 0, under the run folder, offline.

    tpkit train --trackers tensorboard,wandb ...     (default `auto`: tensorboard when installed)

    out/tb/        TensorBoard event file (`tensorboard --logdir out/tb`)
    out/wandb/     W&B offline run (WANDB_MODE=offline unless set: `wandb sync` uploads it)
    out/mlruns/    MLflow file store (`mlflow ui --backend-store-uri out/mlruns`)
    out/trackio/   trackio's local database (TRACKIO_DIR unless set: `trackio show`)

Per step: train/loss, val/loss, optim/lr, optim/grad_norm, perf/tokens_per_s, perf/step_s,
perf/model_tflops_per_s (model FLOPs per token x tokens/s; the planner's formula, passed
in by the command), perf/mfu (that over the devices' peak, when the command knows it: a
GPU the planner has a profile of, a CPU after `tpkit calibrate`), perf/bubble (pipeline idle/busy of rank 0's
stage), and comm/<group>/{bytes,seconds,count} (rank 0's ledger for the step); the
config as hyperparameters. A tracker opens at the first row it gets, so a resumed run
continues its series (TensorBoard purges the steps it redoes).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tpkit.train.config_file import nearest, to_toml

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # each is also its package's name


def installed(package: str) -> bool:
    """Whether `package` can be imported (without importing it)."""
    return importlib.util.find_spec(package) is not None


def chosen(spec: str | None) -> list[str]:
    """The trackers `--log` names: 'a,b'; 'none' (or empty) for none; 'auto': tensorboard
    when it is installed."""
    spec = (spec or "none").strip().lower()
    if spec == "auto":
        return ["tensorboard"] if installed("tensorboard") else []
    return [n.strip() for n in spec.split(",") if n.strip() not in ("", "none")]


def problems(spec: str | None) -> list[str]:
    """Why `--trackers spec` cannot work: an unknown tracker, or one not installed."""
    out = []
    for name in chosen(spec):
        if name not in TRACKERS:
            out.append(f"log={spec!r}: unknown tracker {name!r}{nearest(name, TRACKERS)} "
                       f"(trackers: {', '.join(TRACKERS)}, or none)")
        elif not installed(name):
            out.append(f"log={spec!r}: the {name} package is not installed "
                       f"(pip install {name}, or --trackers none)")
    return out


def scalars(row: dict, flops_per_token: float | None = None,
            peak_flops: float | None = None) -> dict[str, float]:
    """The tracked numbers of one metrics row (MFU with the peak FLOP/s of all devices)."""
    out = {"train/loss": row["loss"], "optim/lr": row["lr"], "optim/grad_norm": row["grad_norm"],
           "perf/tokens_per_s": row["tokens_per_s"], "perf/step_s": row["step_s"]}
    if row.get("val_loss") is not None:
        out["val/loss"] = row["val_loss"]
    busy = row["step_s"] - row.get("idle_s", 0.0)
    if busy > 0:
        out["perf/bubble"] = row.get("idle_s", 0.0) / busy
    if flops_per_token:
        out["perf/model_tflops_per_s"] = flops_per_token * row["tokens_per_s"] / 1e12
        if peak_flops:
            out["perf/mfu"] = flops_per_token * row["tokens_per_s"] / peak_flops
    for group, c in sorted(row.get("comm", {}).items()):
        out |= {f"comm/{group}/bytes": c["bytes"], f"comm/{group}/seconds": c["seconds"],
                f"comm/{group}/count": c["count"]}
    return {k: float(v) for k, v in out.items()}


def hyperparameters(cfg) -> dict:
    """The config, as the scalar values trackers accept (None as 'none')."""
    return {k: ("none" if v is None else v) for k, v in cfg.to_dict().items()}


class Trackers:
    """Every tracker of a run (rank 0): `log(row)` each step, `close()` at the end."""

    def __init__(self, cfg, flops_per_token: float | None = None,
                 peak_flops: float | None = None) -> None:
        self.cfg, self.flops, self.peak = cfg, flops_per_token, peak_flops
        self.names, self.open = chosen(cfg.log), []

    def log(self, row: dict) -> None:
        """One step's row (metrics.jsonl's) to every tracker, opening them at the first."""
        if self.names and not self.open:
            self.open = [_OPENERS[n](self.cfg, Path(self.cfg.out), row["step"])
                         for n in self.names]
        values = scalars(row, self.flops, self.peak)
        for t in self.open:
            t.log(values, row["step"])

    def close(self) -> None:
        """Flush and close every tracker."""
        for t in self.open:
            t.close()
        self.open = []


class _TensorBoard:
    def __init__(self, cfg, out: Path, first_step: int) -> None:
        # lazy: optional (tpkit[track])
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.w = SummaryWriter(log_dir=str(out / "tb"), purge_step=first_step)
        self.w.add_text("config", "```toml\n" + to_toml(cfg) + "```")
        for summary in hparams(hyperparameters(cfg), {"train/loss": 0.0, "val/loss": 0.0}):
            self.w.file_writer.add_summary(summary)

    def log(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class _WandB:
    def __init__(self, cfg, out: Path, first_step: int) -> None:
        # lazy: optional (tpkit[track])
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "tpkit"), dir=str(out),
                              name=out.name, config=hyperparameters(cfg),
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, cfg, out: Path, first_step: int) -> None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a folder, not a server
        # lazy: optional (tpkit[track])
        import mlflow

        self.client = mlflow.MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "tpkit")
        found = self.client.get_experiment_by_name(name)
        exp = found.experiment_id if found else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp, run_name=out.name).info.run_id
        for k, v in hyperparameters(cfg).items():
            self.client.log_param(self.run_id, k, v)

    def log(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.client.log_metric(self.run_id, k, v, step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Trackio:
    def __init__(self, cfg, out: Path, first_step: int) -> None:
        os.environ.setdefault("TRACKIO_DIR", str((out / "trackio").resolve()))  # read at import
        # lazy: optional (tpkit[track])
        import trackio

        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "tpkit"),
                                name=out.name, config=hyperparameters(cfg), embed=False,
                                resume="allow")

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_OPENERS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow,
            "trackio": _Trackio}
