"""Hugging Face interop: small random GPT-2, Llama (GQA, kv heads < tp) and BERT models.

Math checked: a model imported at tp = 1, 2, 4 (each rank reading only its slices)
computes the logits / hidden states of `transformers` on the same inputs (max abs
diff <= 1e-4); exported back (from a model or a sharded checkpoint), `transformers`
loads it and computes the same outputs.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # the `hf` extra, installed by `make test`: never skipped

from tpkit.checkpoint import store as ckpt
from tpkit.checkpoint.convert import to_hf  # checkpoints too
from tpkit.comm import all_gather
from tpkit.mesh import ParallelMesh
from tpkit.weights.sources import load_model

V = 101
IDS = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))
TT = torch.randint(0, 2, (2, 7), generator=torch.Generator().manual_seed(1))
MASK = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])


def make(kind: str):
    t = transformers
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=V,
                                              n_positions=32, bos_token_id=0, eos_token_id=0))
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
            intermediate_size=96, vocab_size=V, max_position_embeddings=64, bos_token_id=0,
            eos_token_id=0, rope_theta=500.0))
    return t.BertModel(t.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                    intermediate_size=128, vocab_size=V,
                                    max_position_embeddings=32))


def hf_out(model, kind: str) -> dict:
    with torch.no_grad():
        if kind == "bert":
            o = model(IDS, attention_mask=MASK, token_type_ids=TT)
            return dict(hidden=o.last_hidden_state, pooled=o.pooler_output)
        return dict(logits=model(IDS).logits)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """kind -> (directory, reference outputs); every weight random (biases, norms too)."""
    out = {}
    g = torch.Generator().manual_seed(3)
    for kind in ("gpt2", "llama", "bert"):
        model = make(kind).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                base = 1.0 if ("norm" in n.lower() or "ln_" in n) and n.endswith("weight") else 0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = (str(path), hf_out(model, kind))
    return out


def tpkit_out(model, mesh, kind: str) -> dict:
    with torch.no_grad():
        if kind == "bert":
            h = model.hidden_states(IDS, attention_mask=MASK, token_types=TT)
            return dict(hidden=h, pooled=model.pooled(h))
        return dict(logits=all_gather(model(IDS), mesh.tp_group, dim=-1)[..., :V])


def import_worker(mesh, path, kind):
    return tpkit_out(load_model(path, mesh).eval(), mesh, kind)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_import_matches_transformers(run_tp, hf_models, kind):
    path, ref = hf_models[kind]
    for tp in (1, 2, 4):
        for out in run_tp(import_worker, tp, path, kind):
            for k in ref:
                diff = (out[k] - ref[k]).abs().max().item()
                assert diff <= 1e-4, (kind, tp, k, diff)


def save_worker(mesh, path, dest):
    ckpt.save(dest, load_model(path, mesh), mesh=mesh)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_export_loads_in_transformers(run_tp, hf_models, tmp_path, kind):
    path, ref = hf_models[kind]
    cls = type(make(kind))
    model = load_model(path, ParallelMesh.single())
    run_tp(save_worker, 2, path, str(tmp_path / "ckpt"), pp=2)  # sharded at (tp=2, pp=2)
    for src in (model, tmp_path / "ckpt"):
        out = tmp_path / f"hf-{type(src).__name__}"
        to_hf(src, out)
        back = cls.from_pretrained(out).eval()
        got = hf_out(back, kind)
        for k in ref:
            assert torch.equal(got[k], ref[k]), (kind, src, k)


def test_unsupported_config_is_named(tmp_path):
    from tpkit.weights.hf import config_from_hf

    with pytest.raises(ValueError, match="model_type 't5' is not supported; supported: .*llama"):
        config_from_hf(dict(model_type="t5"))
    with pytest.raises(Exception, match="config.json"):
        load_model(tmp_path, ParallelMesh.single())


def test_train_reads_a_folder_as_the_loader_does(hf_models, tmp_path):
    """`--from-hf`'s ModelConfig is the loader's (config.json with the tensor names: a
    BERT keeps its pooler), and a folder without config.json is one line naming it."""
    from tpkit.train.config import TrainConfig

    path = hf_models["bert"][0]
    config = TrainConfig(from_hf=path).model_config()
    assert config == load_model(path).config and config.pooler
    problems = TrainConfig(from_hf=str(tmp_path)).problems()
    assert any(p.startswith(f"from_hf={tmp_path}: {tmp_path / 'config.json'}: missing")
               for p in problems), problems
