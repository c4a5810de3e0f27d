"""LoRA: `tpkit train --lora-rank` trains adapters at any tp, the base frozen; `tpkit
convert --to peft` writes PEFT's adapter folder, `--to hf --merge` the merged model.

Math checked: every adapted linear computes W x + (alpha/r) B A x (a hand-written
reference on the full tensors); a tp=2 run's losses are tp=1's (relative 1e-5,
float32: the reduction order only) on SmolLM2's shape (9 heads over 3 kv heads, ffn
99: uneven parts and a kv head both ranks hold); the adapter sends per micro-batch
exactly what the base model sends (the ledger's tp records of a step against a full
fine-tune's); a checkpoint resumes at another tp; PEFT's model with the exported
adapters, and transformers' with the merged weights, compute tpkit's logits.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tpkit.cli import main as tpkit_main
from tpkit.mesh import ParallelMesh
from tpkit.spec import get_preset
from tpkit.spec.config import LORA_TARGETS
from tpkit.train.config import TrainConfig
from tpkit.train.loop import train
from tpkit.weights.build import build_model

STEPS, SEQ, BATCH = 4, 32, 4
ALL = ",".join(LORA_TARGETS)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """A SmolLM2-shaped tiny Llama (9 heads / 3 kv heads, ffn 99, tied) and its data."""
    from hf_folders import SMOL, TEXT, tiny_llama_folder

    root = tmp_path_factory.mktemp("lora")
    folder = tiny_llama_folder(root / "smol", initializer_range=0.3, **SMOL)
    (root / "text.txt").write_text(TEXT)
    assert tpkit_main(["prepare-data", str(root / "text.txt"), "--tokenizer", str(folder),
                       "--out", str(root / "data"), "--no-progress"]) == 0
    return folder, root / "data"


def _cfg(smol, out: Path, **kw) -> TrainConfig:
    folder, data = smol
    base = dict(from_hf=str(folder), data=str(data), lora_rank=4, lora_alpha=8.0,
                lora_targets=ALL, steps=STEPS, micro_batches=2, global_batch=BATCH, seq=SEQ,
                lr=2e-2, warmup=1, clip=0.5, val_fraction=0.0, out=str(out), progress=False,
                plot=False, log="none", ckpt_every=2, keep_checkpoints=0)
    return TrainConfig(**{**base, **kw})


def _train(mesh, cfg: TrainConfig) -> dict:
    r = train(cfg, mesh)
    per_micro_batch = Counter((x.op, x.phase, x.numel) for x in mesh.ledger.records
                              if x.group == "tp" and x.phase in ("forward", "backward"))
    return dict(losses=r.losses, theory_ok=r.theory_ok, sent=per_micro_batch)


def _worst(got: list[float], want: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(got, want, strict=True))


def test_every_adapted_linear_is_the_hand_written_reference():
    config = get_preset("gpt2-tiny").with_(
        num_heads=6, kv_heads=2, hidden=48, activation="swiglu", norm="rmsnorm",
        position="rope", lora_rank=3, lora_alpha=6.0, lora_targets=LORA_TARGETS)
    model = build_model(config, ParallelMesh.single(), seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora.B." in name:  # B starts at zero: give the adapters something to add
                p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(2, 5, 48, generator=g)
    block, s = model.layers["0"], 6.0 / 3
    for path, parts in (("attn.qkv", "qkv"), ("attn.out", "o"), ("mlp.fc1", ["gate", "up"]),
                        ("mlp.fc2", ["down"])):
        lin = block.get_submodule(path)
        a, b = lin.lora.A, lin.lora.B
        inp = x if lin.in_features == 48 else torch.randn(2, 5, lin.in_features, generator=g)
        delta = torch.cat([F.linear(F.linear(inp, a[t]), b[t]) for t in parts], -1)
        want = F.linear(inp, lin.weight, lin.bias) + s * delta
        got = lin(inp)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), path
        assert (s * delta).abs().max() > 1e-2  # the adapter's part is not negligible
    frozen = [n for n, p in model.named_parameters() if p.requires_grad != (".lora." in n)]
    assert frozen == []  # every base weight frozen, every adapter trained


@pytest.fixture(scope="module")
def runs(smol, run_tp, tmp_path_factory):
    """tp=1 and tp=2 runs of 4 steps (checkpoints at 2 and 4), the tp=2 run resumed from
    tp=1's step 2, one step of a full fine-tune at tp=2 (what the base sends) and one of
    adapters on o and down only, tp=2 with sequence parallelism and recomputation, and
    tp=1 in bf16 on fp32 master weights."""
    root = tmp_path_factory.mktemp("runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the pool's workers
    try:
        one = _train(ParallelMesh.single(), _cfg(smol, root / "tp1"))
        mixed = _train(ParallelMesh.single(), _cfg(smol, root / "bf16", dtype="bfloat16",
                                                   master_weights=True, checkpoint=False))
    finally:
        torch.set_num_threads(threads)
    two = run_tp(_train, 2, _cfg(smol, root / "tp2", tp=2))[0]
    step2 = root / "tp1" / "checkpoints" / "step_000002"
    resumed = run_tp(_train, 2, _cfg(smol, root / "resumed", tp=2, resume=str(step2)))[0]
    full = run_tp(_train, 2, _cfg(smol, root / "full", tp=2, lora_rank=0, steps=1,
                                  checkpoint=False))[0]
    sp = run_tp(_train, 2, _cfg(smol, root / "sp", tp=2, sp=True, recompute=True,
                                checkpoint=False))[0]
    late = run_tp(_train, 2, _cfg(smol, root / "late", tp=2, lora_targets="o,down", steps=1,
                                  checkpoint=False))[0]  # layer 0's qkv: no adapter
    return dict(root=root, one=one, two=two, resumed=resumed, full=full, sp=sp, mixed=mixed,
                late=late)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tp2_trains_the_adapters_as_tp1_sending_what_the_base_sends(runs):
    one, two, full = runs["one"], runs["two"], runs["full"]
    assert one["losses"][-1] < one["losses"][0] - 0.05  # the adapters learn
    assert _worst(two["losses"], one["losses"]) <= 1e-5
    assert two["theory_ok"]
    assert two["sent"] == full["sent"] and sum(full["sent"].values()) > 0
    assert runs["late"]["sent"] == full["sent"] and runs["late"]["theory_ok"]
    # with SP the frozen embedding's backward all-gather is the one thing not sent; the
    # recomputed layers take the adapters' gradients although their input takes none
    assert runs["sp"]["theory_ok"] and _worst(runs["sp"]["losses"], one["losses"]) <= 1e-5
    # bf16 on fp32 masters: every weight and activation rounded to 8 bits of mantissa
    assert _worst(runs["mixed"]["losses"], one["losses"]) <= 1e-2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_checkpoint_holds_adapter_state_only_and_resumes_at_another_tp(runs):
    manifest = json.loads((runs["root"] / "tp1" / "checkpoints" / "step_000004" /
                           "manifest.json").read_text())
    moments = {k.split("::")[0] for k in manifest["optim_tensors"]}
    assert moments and all(".lora." in n for n in moments)  # no state for the frozen base
    assert _worst(runs["resumed"]["losses"], runs["one"]["losses"][2:]) <= 1e-5


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_peft_loads_the_adapters_and_the_merged_model_is_the_same(runs, smol, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tpkit.weights.sources import load_model

    run = runs["root"] / "tp2"
    for argv in (["--to", "peft"], ["--to", "hf", "--merge"]):
        assert tpkit_main(["convert", str(run), str(tmp_path / argv[1]), *argv]) == 0
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = load_model(str(run), ParallelMesh.single()).eval()(ids)[..., :300]
    base = AutoModelForCausalLM.from_pretrained(str(smol[0]), dtype=torch.float32).eval()
    assert (_logits(base, ids) - ours).abs().max() > 1e-2  # the adapters changed the model
    peft = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    assert (_logits(peft, ids) - ours).abs().max() <= 1e-4
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert (_logits(merged.eval(), ids) - ours).abs().max() <= 1e-4


@pytest.mark.slow
def test_an_export_that_would_drop_the_adapters_is_refused(runs, capsys, tmp_path):
    run = str(runs["root"] / "tp1")
    assert tpkit_main(["convert", run, str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert tpkit_main(["convert", run, str(tmp_path / "f"), "--to", "full", "--merge"]) == 2
    err = capsys.readouterr().err
    assert "holds LoRA adapters: --to hf --merge" in err and "goes with --to hf" in err
    assert not (tmp_path / "hf").exists()
