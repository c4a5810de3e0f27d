"""Every Hugging Face family against `transformers` itself, at tp = 1, 2, 4.

Math checked, per family (small random models built and saved by transformers):
loaded at tp (each rank reading only its slices, fused tensors included), the
logits, the loss and every parameter's gradient equal transformers' (max |diff| <=
1e-4, float32); the ledger holds exactly `theory.layer` per layer (Mixtral: the
dense MLP's one all-reduce forward and one backward, however many experts); the
export writes back exactly the tensors transformers saved (bit-identical).
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from tpkit.checkpoint import convert
from tpkit.checkpoint import store as ckpt
from tpkit.comm import all_gather
from tpkit.decode.paged_kv import NONE, PagedCache, Piece, forward
from tpkit.weights.hf_check import compare, gather, reference, tp_case
from tpkit.weights.sources import load_model

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=101,
             max_position_embeddings=64)


def make(kind: str):
    """A small random model of each family, as transformers builds it."""
    kv = dict(num_attention_heads=8, num_key_value_heads=2)
    return {
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, **kv, tie_word_embeddings=True)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**SMALL, num_attention_heads=4,
                                                          num_key_value_heads=2, head_dim=32)),
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, **kv, rope_parameters=dict(
            rope_type="llama3", rope_theta=500.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=16))),  # Llama 3.1 scaling
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, **kv, sliding_window=4)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**SMALL, num_attention_heads=4,
                                                          num_key_value_heads=1, head_dim=32)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**SMALL, **kv, pad_token_id=0)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**SMALL, num_attention_heads=4)),
        "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**SMALL, **kv, num_local_experts=4)),
    }[kind]()


FAMILIES = ["qwen2", "qwen3", "llama", "mistral", "gemma", "phi3", "gpt_neox", "mixtral"]
IDS = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> directory of a random model (norms near their identity, biases random)."""
    def save(kind: str) -> str:
        model = make(kind).eval()
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for n, p in model.named_parameters():
                base = 1.0 if "norm" in n and kind != "gemma" and p.dim() == 1 else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        return str(path)
    return {kind: save(kind) for kind in FAMILIES}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_and_grads_match_transformers(run_tp, saved, kind):
    ref = reference(saved[kind], IDS)
    for tp in (1, 2, 4):
        results = run_tp(tp_case, tp, saved[kind], IDS)
        diffs = compare(ref, gather(results))
        print(f"{kind} tp={tp}: " + " ".join(f"{k}={v:.1e}" for k, v in diffs.items()))
        assert max(diffs.values()) <= 1e-4, (kind, tp, diffs)
        assert results[0]["problems"] == [], (kind, tp, results[0]["problems"])
    sp = compare(ref, gather(run_tp(tp_case, 2, saved[kind], IDS, True)))  # sequence parallel
    assert sp["grads"] <= 1e-4 and sp["loss"] <= 1e-4, (kind, "sp", sp)
    odd = IDS[:, :7]  # SP on 7 tokens: 4 + 3, the ledger as the (padded) theory says
    results = run_tp(tp_case, 2, saved[kind], odd, True)
    sp = compare(reference(saved[kind], odd), gather(results))
    assert max(sp.values()) <= 1e-4 and results[0]["problems"] == [], (kind, "sp odd", sp)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_mixtral_expert_parallel_matches_transformers(run_tp, saved):
    """Whole experts spread over tp (E/tp per rank): the same logits and gradients, the
    same one all-reduce per MLP."""
    ref = reference(saved["mixtral"], IDS)
    for tp in (2, 4):
        results = run_tp(tp_case, tp, saved["mixtral"], IDS, False, True)
        diffs = compare(ref, gather(results))
        print(f"mixtral expert-parallel tp={tp}: " +
              " ".join(f"{k}={v:.1e}" for k, v in diffs.items()))
        assert max(diffs.values()) <= 1e-4 and results[0]["problems"] == [], (tp, diffs)


def save_worker(mesh, path, dest, ep=False):
    ckpt.save(dest, load_model(path, mesh, expert_parallel=ep), mesh=mesh)


def reload_worker(mesh, path, ckpt_dir, ids):
    """Logits of a tensor-parallel model loaded from a checkpoint written expert-parallel."""
    model = load_model(path, mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ckpt.load(ckpt_dir, model, mesh=mesh)
    with torch.no_grad():
        return all_gather(model(ids), mesh.tp_group, dim=-1)[..., :101]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_mixtral_checkpoint_moves_between_expert_and_tensor_parallel(run_tp, saved, tmp_path):
    """The split tags, not the names, decide: experts saved whole per rank load split."""
    run_tp(save_worker, 2, saved["mixtral"], str(tmp_path / "ep"), True)
    hf = T.MixtralForCausalLM.from_pretrained(saved["mixtral"]).eval()
    with torch.no_grad():
        want = hf(IDS).logits
    for got in run_tp(reload_worker, 2, saved["mixtral"], str(tmp_path / "ep"), IDS):
        assert (got - want).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["qwen2", "phi3", "gpt_neox", "mixtral", "mixtral-ep"])
def test_export_from_a_sharded_checkpoint_is_bit_identical(run_tp, saved, tmp_path, kind):
    kind, ep = kind.removesuffix("-ep"), kind.endswith("-ep")  # experts spread whole
    run_tp(save_worker, 2, saved[kind], str(tmp_path / "ckpt"), ep, pp=2)  # (tp=2, pp=2)
    convert.to_hf(tmp_path / "ckpt", tmp_path / "out")
    original = load_file(f"{saved[kind]}/model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original), kind


@pytest.mark.parametrize("kind", FAMILIES)
def test_export_is_bit_identical(saved, tmp_path, kind):
    original = load_file(f"{saved[kind]}/model.safetensors")
    convert.to_hf(load_model(saved[kind]), tmp_path / "out")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original), kind
    hf_params = sum(p.numel() for p in make(kind).parameters())
    assert load_model(saved[kind]).config.num_params() == hf_params, kind  # spec's count
    back = type(make(kind)).from_pretrained(tmp_path / "out").eval()
    again = type(make(kind)).from_pretrained(saved[kind]).eval()
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, again(IDS).logits), kind
        # a live transformers model reads the same (Mixtral: its fused in-memory experts)
        assert torch.equal(load_model(again)(IDS), load_model(saved[kind])(IDS)), kind


def cached_worker(mesh, path, ids):
    """Logits of the last 3 positions, computed one token at a time with the paged KV
    cache (blocks of 4 tokens, each row's blocks interleaved with the others': the keys
    are gathered from scattered blocks), against the full forward's, gathered over tp."""
    model = load_model(path, mesh).eval()
    (b, s), bs = ids.shape, 4
    cache = PagedCache(model, block_size=bs)
    span = -(-s // bs)
    cache.grow(1 + b * span)
    tables = [[1 + i + b * j for j in range(span)] for i in range(b)]
    rows = ids.tolist()
    with torch.no_grad():
        forward(model, cache, [Piece(r[:-3], 0, t, NONE) for r, t in zip(rows, tables)])
        steps = [forward(model, cache, [Piece([r[t]], t, tab) for r, tab in zip(rows, tables)])[0]
                 for t in range(s - 3, s)]  # [b, V] each
        V = model.config.vocab_size
        full = all_gather(model(ids)[:, -3:], model.group, dim=-1)[..., :V].float()
    return (torch.stack(steps, 1) - full).abs().max().item()


@pytest.mark.parametrize("kind", FAMILIES)
def test_kv_cache_decoding_equals_the_full_forward(run_tp, saved, kind):
    """Rotary offsets (partial too), q/k norms, the sliding window and routing all hold
    when the keys come from the cache: token-by-token logits = the full forward's."""
    for tp in (1, 2):
        assert max(run_tp(cached_worker, tp, saved[kind], IDS)) <= 1e-5, (kind, tp)


def route_worker(mesh, path, ids, ep):
    """tpkit's routing at layer 0 on the hidden states its MoE receives."""
    model = load_model(path, mesh, expert_parallel=ep).eval()
    seen = {}
    moe = model.layers["0"].mlp
    moe.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0].detach()))
    with torch.no_grad():
        model(ids)
        weights, experts = moe.route(seen["x"].reshape(-1, seen["x"].shape[-1]))
    return seen["x"], weights, experts


@pytest.mark.timeout(120)
def test_mixtral_routing_matches_transformers(run_tp, saved):
    hf = T.MixtralForCausalLM.from_pretrained(saved["mixtral"]).eval()
    seen = {}
    hf.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    with torch.no_grad():
        hf(IDS)
        _, weights, experts = hf.model.layers[0].mlp.gate(seen["x"].reshape(-1, 64))
    for tp, ep in ((1, False), (2, False), (2, True)):
        for x, w, e in run_tp(route_worker, tp, saved["mixtral"], IDS, ep):
            assert (x - seen["x"]).abs().max() <= 1e-5
            assert torch.equal(e, experts), tp  # the same experts for every token
            assert (w - weights).abs().max() <= 1e-6, tp


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_verify_hf_prints_the_table(saved, capsys):
    from tpkit.cli import main

    assert main(["verify", "--hf", saved["qwen3"], "--tp", "1,2", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "against transformers" in out and "OK: every tp matches transformers" in out


def test_verify_hf_names_what_it_cannot_read(tmp_path, capsys):
    from tpkit.cli import main

    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    assert main(["verify", "--hf", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpkit verify: error: ") and \
        "'t5' is not supported; supported: bert, gemma" in err


def test_unsupported_family_names_the_supported(tmp_path):
    from tpkit.weights.families import config_from_hf

    with pytest.raises(ValueError, match="'t5' is not supported; supported: bert, gemma, gpt2"):
        config_from_hf({"model_type": "t5"})
    with pytest.raises(ValueError, match="qwen2 variant not supported: sliding-window layers"):
        config_from_hf({"model_type": "qwen2", "use_sliding_window": True,
                        "layer_types": ["sliding_attention"]})


def test_a_config_without_family_exports_as_its_plain_shape_or_is_refused():
    """Configs saved before `family` existed keep exporting (GPT-2, Llama, BERT shapes);
    a config with one family's feature is never guessed."""
    from dataclasses import replace

    from tpkit.spec import get_preset
    from tpkit.weights.families import with_family

    for preset, kind in (("gpt2-tiny", "gpt2"), ("llama-tiny", "llama")):
        assert with_family(replace(get_preset(preset), family="")).family == kind
    qk = replace(get_preset("llama-tiny"), family="", qk_norm=True)
    with pytest.raises(ValueError, match="no Hugging Face family"):
        with_family(qk)
