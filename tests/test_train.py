"""The training loop and `tpkit train`: a short run on the embedded corpus lowers the
loss and leaves metrics, a plot and checkpoints; bad input fails before training
starts, on every rank, with the numbers named; the TOML config mirrors the flags."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from tpkit.cli import main
from tpkit.mesh import ParallelMesh
from tpkit.spec.errors import UserError
from tpkit.train.config import TrainConfig
from tpkit.train.loop import train
from tpkit.train.optim import lr_at
from tpkit.train.run_folder import hold


def _short_run(mesh, out: str) -> dict:
    cfg = TrainConfig(preset="gpt2-tiny", tp=mesh.tp_size, pp=mesh.pp_size, steps=30,
                      micro_batches=2, global_batch=8, seq=64, lr=3e-3, warmup=5, eval_every=15,
                      ckpt_every=20, out=out, progress=False)
    r = train(cfg, mesh)
    return {k: getattr(r, k) for k in ("losses", "val_loss", "plot", "checkpoint", "metrics", "theory_ok",
                              "tokens_per_s")}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_short_run_lowers_loss_and_leaves_outputs(run_tp, tmp_path):
    r = run_tp(_short_run, 2, str(tmp_path), pp=2)[0]
    first, last = sum(r["losses"][:3]) / 3, sum(r["losses"][-3:]) / 3
    assert first > 5.0 > 4.0 > last  # from ~ln(256) = 5.5 towards the byte statistics
    assert r["val_loss"] < first and r["theory_ok"] and r["tokens_per_s"] > 0
    rows = [json.loads(line) for line in Path(r["metrics"]).read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 31))
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "comm"} <= set(rows[0])
    assert {"tp", "pp", "tied"} <= set(rows[0]["comm"])  # the step's traffic, per group
    assert [row["step"] for row in rows if "val_loss" in row] == [15, 30]
    assert Path(r["plot"]).stat().st_size > 1000
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step_000020", "step_000030"] and r["checkpoint"].endswith("step_000030")


def _bad(mesh, out: str, changes: dict) -> str:
    cfg = TrainConfig(tp=mesh.tp_size, pp=mesh.pp_size, dp=mesh.dp_size, steps=1, seq=32,
                      out=out, progress=False, **changes)
    try:
        train(cfg, mesh)
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_bad_input_fails_on_every_rank_before_training(run_tp, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    cases = [
        (dict(pp=1, dp=2), dict(global_batch=10, micro_batches=4),
         "global_batch=10 is not divisible by dp*micro_batches = 2*4 = 8"),
        (dict(pp=4, dp=1), dict(preset="bert-tiny"), "pp=4 stages is more than num_layers=2"),
        (dict(pp=2, dp=1), dict(data=str(tmp_path / "empty.txt")), "is empty (0 tokens)"),
        (dict(pp=2, dp=1), dict(data=str(tmp_path / "nope.txt")), "nope.txt does not exist"),
    ]
    for layout, changes, message in cases:
        errors = run_tp(_bad, 4 // (layout["pp"] * layout["dp"]), str(tmp_path / "run"), changes,
                        **layout)
        assert all(message in e for e in errors), (message, errors)


def test_cli_reports_errors_before_spawning(capsys, tmp_path):
    assert main(["train", "--tp", "2", "--pp", "5", "--steps", "1"]) == 2
    assert "pp=5 stages is more than num_layers=4" in capsys.readouterr().err
    assert main(["train", "--dp", "2", "--global-batch", "6", "--micro-batches", "2"]) == 2
    assert "global_batch=6 is not divisible by dp*micro_batches = 2*2 = 4" in \
        capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "missing.bin")]) == 2
    assert "missing.bin does not exist" in capsys.readouterr().err


def test_toml_config_mirrors_flags(tmp_path):
    from tpkit.commands.train import add_arguments, config_from_args

    toml = tmp_path / "run.toml"
    toml.write_text('preset = "llama-tiny"\ntp = 2\npp = 2\nmicro-batches = 4\nzero1 = true\n'
                    'schedule = "gpipe"\nlr = 1e-3\n')
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--config", str(toml), "--lr", "2e-3"]), None)
    assert (cfg.preset, cfg.tp, cfg.pp, cfg.micro_batches, cfg.zero1, cfg.schedule, cfg.lr) == \
        ("llama-tiny", 2, 2, 4, True, "gpipe", 2e-3)  # the flag overrides the file
    cfg = config_from_args(parser.parse_args(["--tp", "2", "--processes", "8"]), 8)
    assert cfg.dp == 4  # what the processes leave over
    toml.write_text("tp = 2\nmicro_batchez = 4\n")
    with pytest.raises(ValueError, match="unknown key .micro_batchez.; did you mean .micro_batches."):
        TrainConfig.from_toml(toml)


def test_warmup_then_cosine():
    cfg = TrainConfig(steps=110, warmup=10, lr=1e-3, min_lr=1e-4)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(5.5e-4) and lr_at(110, cfg) == pytest.approx(1e-4)


@pytest.mark.timeout(60)
def test_bfloat16_autocast_trains(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = TrainConfig(steps=8, global_batch=4, seq=32, lr=1e-2, dtype="bfloat16",
                          val_fraction=0.0, out=str(tmp_path), progress=False, plot=False,
                          checkpoint=False)
        r = train(cfg, ParallelMesh.single())
    finally:
        torch.set_num_threads(threads)
    assert all(math.isfinite(v) for v in r.losses) and r.losses[-1] < r.losses[0]


def _auto_and_refused(mesh, out: str) -> dict:
    """train() from Python holds the folder as `tpkit train` does (`train.run_policy`)."""
    kw = dict(tp=mesh.tp_size, global_batch=4, seq=32, val_fraction=0.0, progress=False,
              plot=False, out=out)
    train(TrainConfig(**kw, steps=2), mesh)
    auto = train(TrainConfig(**kw, steps=3, resume="auto"), mesh)  # step_000002 -> step 3
    said = {}
    try:
        train(TrainConfig(**kw, steps=3), mesh)  # a new run into a run's folder
    except UserError as e:
        said["earlier"] = str(e)
    with hold(Path(out)) if mesh.rank == 0 else nullcontext():  # the folder in use
        try:
            train(TrainConfig(**kw, steps=4, resume="auto"), mesh)
        except UserError as e:
            said["locked"] = str(e)
    train(TrainConfig(**kw, steps=1), mesh, overwrite=True)  # the earlier run's go first
    return dict(first_step=auto.first_step, losses=len(auto.losses), said=said)


@pytest.mark.timeout(60)
def test_train_from_python_resumes_auto_and_refuses_a_held_folder(run_tp, tmp_path):
    for r in run_tp(_auto_and_refused, 2, str(tmp_path)):  # every rank says the same line
        assert (r["first_step"], r["losses"]) == (3, 1)
        assert r["said"]["earlier"].startswith(f"--out {tmp_path} holds an earlier run "
                                               f"(checkpoints up to step_000003)")
        assert r["said"]["locked"].startswith(f"--out {tmp_path} is in use by another run "
                                              f"(pid ")
        assert not any("\n" in line for line in r["said"].values())
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]


def _zero1_state(mesh) -> dict:
    from tpkit.parallel import ZeroAdamW, allreduce_grads
    from tpkit.train.optim import param_groups

    torch.manual_seed(0)  # replicas start equal, as the model's seeded init makes them
    nets = [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)) for _ in range(2)]
    torch.manual_seed(1 + mesh.dp_rank)  # different data per replica
    nets[1].load_state_dict(nets[0].state_dict())
    zero = ZeroAdamW(param_groups(nets[0], 0.1), mesh.dp_group, lr=0.1)
    plain = torch.optim.AdamW(param_groups(nets[1], 0.1), lr=0.1)
    x = torch.randn(4, 5)
    for net, opt in ((nets[0], zero), (nets[1], plain)):
        for _ in range(3):
            net(x).square().sum().backward()
            allreduce_grads(list(net.parameters()), mesh.dp_group)
            opt.step()
            opt.zero_grad()
    state = [v for s in zero.inner.state.values() for k, v in s.items() if k != "step"]
    return dict(moments=sum(t.numel() for t in state), params=nets[0].state_dict(),
                same=all(torch.allclose(a, b, atol=1e-6) for a, b in
                         zip(nets[0].parameters(), nets[1].parameters())))


@pytest.mark.timeout(60)
def test_zero1_shards_adam_state_and_matches_adamw(pools):
    r = pools.run(_zero1_state, 2, mesh=dict(tp=1, pp=1, dp=2))
    n_matrix, n_vector = 5 * 7 + 7 * 3, 7 + 3  # decayed and undecayed groups, each split in 2
    assert [x["moments"] for x in r] == [2 * (n_matrix // 2 + n_vector // 2)] * 2
    assert all(x["same"] for x in r)  # the sharded update is AdamW's
    assert all(torch.equal(r[0]["params"][k], r[1]["params"][k]) for k in r[0]["params"])


def _resumed(mesh, out: str) -> dict:
    kw = dict(tp=mesh.tp_size, steps=6, global_batch=4, seq=32, val_fraction=0.0,
              progress=False, plot=False)
    straight = train(TrainConfig(**kw, ckpt_every=3, out=out + "/a"), mesh)
    again = train(TrainConfig(**kw, out=out + "/b", resume=out + "/a/checkpoints/step_000003"),
                  mesh)
    return dict(straight=straight.losses, resumed=again.losses)


@pytest.mark.timeout(60)
def test_resume_continues_the_same_run(run_tp, tmp_path):
    r = run_tp(_resumed, 2, str(tmp_path))[0]
    assert len(r["resumed"]) == 3  # steps 4..6: weights, AdamW moments, loader position
    for a, b in zip(r["straight"][3:], r["resumed"]):
        assert math.isclose(a, b, rel_tol=1e-6), (r["straight"], r["resumed"])
