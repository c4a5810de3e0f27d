"""Experiment tracking through the trackers' own libraries, offline, under the run
folder: the TensorBoard event file read back with tensorboard's EventAccumulator holds
the loss series of metrics.jsonl (and, at tp=2, the tp group's bytes from the ledger,
and the config as hyperparameters); W&B (offline), MLflow (file store) and trackio
(local database) get the same losses."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tpkit.cli import main
from tpkit.train.config import TrainConfig
from tpkit.train.trackers import chosen, installed, problems, scalars

pytest.importorskip("tensorboard", reason="make test installs it (the [track] extra)")


def _rows(out: Path) -> list[dict]:
    return [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]


def _events(out: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    return acc


def test_log_names_are_checked():
    assert chosen("auto") == ["tensorboard"] and chosen("none") == [] and chosen(None) == []
    assert chosen("tensorboard,wandb") == ["tensorboard", "wandb"]
    assert "unknown tracker 'tensorbord'; did you mean 'tensorboard'?" in problems("tensorbord")[0]
    with pytest.raises(ValueError, match="unknown tracker 'mlfow'"):
        TrainConfig(log="tensorboard,mlfow").check()


def _train_tp2(mesh, cfg):
    from tpkit.commands.train import trackers
    from tpkit.train.loop import train

    return train(cfg, mesh, trackers=trackers(cfg, mesh)).losses


def test_utilisation_is_model_flops_over_the_known_peak():
    from tpkit.plan.hardware import PROFILES, profile_of_device

    row = dict(loss=2.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1e4, step_s=0.5, idle_s=0.1,
               comm={"tp": dict(bytes=10, seconds=0.01, count=2)})
    got = scalars(row, flops_per_token=3e9, peak_flops=2 * 1e14)
    assert got["perf/model_tflops_per_s"] == pytest.approx(30.0)
    assert got["perf/mfu"] == pytest.approx(0.15) and got["perf/bubble"] == pytest.approx(0.25)
    assert "perf/mfu" not in scalars(row, 3e9) and got["comm/tp/count"] == 2.0
    assert profile_of_device("NVIDIA H100 80GB HBM3") is PROFILES["h100"]
    assert profile_of_device("NVIDIA A100-SXM4-80GB") is PROFILES["a100-80gb"]
    assert profile_of_device("Some Other GPU") is None


@pytest.mark.timeout(180)
def test_tensorboard_holds_the_loss_and_the_tp_traffic(run_tp, tmp_path):
    cfg = TrainConfig(tp=2, steps=3, seq=16, global_batch=2, warmup=1, val_fraction=0.1,
                      eval_every=3, out=str(tmp_path), progress=False, plot=False,
                      checkpoint=False, log="tensorboard")
    run_tp(_train_tp2, 2, cfg)
    rows, acc = _rows(tmp_path), _events(tmp_path)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [e.value for e in acc.Scalars("comm/tp/bytes")] == [r["comm"]["tp"]["bytes"]
                                                               for r in rows]
    assert acc.Scalars("val/loss")[-1].value == pytest.approx(rows[-1]["val_loss"], rel=1e-6)
    tags = set(acc.Tags()["scalars"])
    assert {"optim/lr", "optim/grad_norm", "perf/tokens_per_s", "perf/model_tflops_per_s",
            "comm/tp/seconds"} <= tags
    assert "hparams" in acc.PluginTagToContent("hparams") or acc.PluginTagToContent("hparams")
    assert "tp = 2" in acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_wandb_mlflow_trackio_offline_get_the_losses(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default: never the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is imported
    for tracker in ("wandb", "mlflow", "trackio"):
        if not installed(tracker):
            pytest.skip(f"{tracker} is not installed (make test installs the [track] extra)")
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--seq", "16", "--global-batch", "2", "--warmup", "1",
                 "--val-fraction", "0", "--no-progress", "--out", str(out),
                 "--trackers", "wandb,mlflow,trackio"]) == 0
    losses = [r["loss"] for r in _rows(out)]
    (record,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"train/loss" in record.read_bytes()
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tpkit").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(losses)
    assert run.data.params["seq"] == "16"
    (db,) = (tmp_path / "trackio").glob("*.db")
    with sqlite3.connect(db) as c:
        logged = [json.loads(m) for (m,) in c.execute("select metrics from metrics order by step")]
    assert [m["train/loss"] for m in logged] == pytest.approx(losses)
