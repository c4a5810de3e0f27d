"""Tensor-parallel generation with a KV cache.

Math checked: the cached decode equals recomputing the whole sequence each step
(the cache holds exactly the keys/values the full forward would); greedy tokens at
tp=2 (and tp=4 with kv heads shared, GQA kv=2 < tp) equal those at tp=1, token for
token; sampling with the same seed is identical across tp too.
"""

from __future__ import annotations

import pytest
import torch

from checkpoint_helpers import GPT2, LLAMA, fill, random_full
from helpers import generate_args
from tpkit.checkpoint import load_model
from tpkit.checkpoint import store as ckpt
from tpkit.comm import all_gather
from tpkit.commands.generate import run
from tpkit.decode.generate import PP_ERROR, generate, pad_left
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.spec.errors import UserError
from tpkit.weights.tokenizer import ByteTokenizer

PROMPT = torch.tensor([[5, 17, 200, 3, 99]])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """config name -> tpkit checkpoint dir (tp=1) with random weights."""
    out = {}
    for config in (LLAMA, GPT2):
        mesh = ParallelMesh.single()
        model = Transformer(config, mesh)
        fill(model, random_full(config, seed=5, scale=1.0), mesh)
        out[config.name] = str(tmp_path_factory.mktemp(config.name))
        ckpt.save(out[config.name], model, mesh=mesh)
    return out


def gen_worker(mesh, path, n, temperature, top_k):
    model = load_model(path, mesh)
    return generate(model, PROMPT, n, temperature=temperature, top_k=top_k, seed=7)


def recompute_worker(mesh, path, n):
    """Greedy without a cache: the whole sequence through the model every step."""
    model = load_model(path, mesh).eval()
    ids = PROMPT
    with torch.no_grad():
        for _ in range(n):
            logits = all_gather(model(ids)[:, -1], mesh.tp_group, dim=-1)
            ids = torch.cat([ids, logits[:, :model.config.vocab_size].argmax(-1,
                                                                            keepdim=True)], 1)
    return ids


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["llama-t", "gpt2-t"])
def test_greedy_same_tokens_at_any_tp(run_tp, checkpoints, name):
    path = checkpoints[name]
    want = recompute_worker(ParallelMesh.single(), path, 12)
    assert len(set(want[0, 5:].tolist())) > 1, "a degenerate sequence would prove little"
    assert torch.equal(gen_worker(ParallelMesh.single(), path, 12, 0.0, None), want)
    for tp in (2, 4) if name == "llama-t" else (2,):
        for got in run_tp(gen_worker, tp, path, 12, 0.0, None):
            assert torch.equal(got, want), (tp, got, want)
    sampled = run_tp(gen_worker, 2, path, 12, 0.8, 20)
    assert torch.equal(sampled[0], sampled[1])
    assert torch.equal(sampled[0], gen_worker(ParallelMesh.single(), path, 12, 0.8, 20))


def test_cli_and_tokenizer(checkpoints, capsys):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("tensor é")) == "tensor é"
    assert tok.decode([*tok.encode("ab"), 300]) == "ab"  # ids >= 256 are no bytes: dropped
    args = generate_args("--checkpoint", checkpoints["gpt2-t"], "--prompt", "ab",
                         "--max-new-tokens", "4", "--max-batch", "8", "--batch-invariant", "--decode-chunk", "8")
    assert run(args) == 0
    out = capsys.readouterr()
    assert out.out.startswith("ab") and "tokens/s" in out.err
    args.prompt, args.prompt_ids = [], ["1,2,3", "4"]
    assert run(args) == 0
    rows = capsys.readouterr().out.strip().split("\n\n")
    assert [len(r.split()) for r in rows] == [4, 4]
    args.prompt_ids = ["1,300"]
    with pytest.raises(UserError, match=r"prompt token ids \[300\] are outside the model's "
                                        r"vocabulary \[0, 257\)"):
        run(args)  # one line and exit 2 from tpkit.cli


PROMPTS = [[5, 17, 200, 3, 99, 8, 41], [250, 2], [7, 7, 120, 64]]  # lengths 7, 2, 4


def batch_worker(mesh, path, n):
    """(batched tokens per row, each prompt alone, prefill logits batched and alone)."""
    model = load_model(path, mesh)
    ids, mask = pad_left(PROMPTS, pad_id=1)
    batched = generate(model, ids, n, attention_mask=mask)[:, ids.shape[1]:]
    alone = [generate(model, torch.tensor([p]), n)[0, len(p):] for p in PROMPTS]
    with torch.no_grad():
        pads = ids.shape[1] - mask.sum(1)  # [b]: each row starts at position 0
        full = all_gather(model(ids, attention_mask=mask, position_offset=-pads)[:, -1],
                          mesh.tp_group, dim=-1)
        one = [all_gather(model(torch.tensor([p]))[:, -1], mesh.tp_group, dim=-1)[0]
               for p in PROMPTS]
    rel = (full - torch.stack(one)).abs().max() / full.abs().max()  # logits are ~1e2 here
    return batched, torch.stack(alone), rel.item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["llama-t", "gpt2-t"])
def test_batch_of_different_lengths_equals_each_alone(run_tp, checkpoints, name):
    """Left padding + mask: every row generates what it would alone (learned positions
    per row for GPT-2, rotary's shift invariance for Llama), at tp=1 and tp=2."""
    for tp in (1, 2):
        for batched, alone, diff in run_tp(batch_worker, tp, checkpoints[name], 10):
            assert torch.equal(batched, alone), (tp, batched, alone)
            assert diff <= 1e-5, (tp, diff)  # float32 round-off (relative)
            assert len(set(alone[1].tolist())) > 1


def test_eos_stops_rows_then_pads(checkpoints):
    model = load_model(checkpoints["gpt2-t"], ParallelMesh.single())
    ids, mask = pad_left(PROMPTS, pad_id=1)
    free = generate(model, ids, 8, attention_mask=mask)[:, ids.shape[1]:]
    eos = int(free[1, 2])  # row 1 emits it at step 2 (maybe other rows too)
    got = generate(model, ids, 8, attention_mask=mask, eos_id=eos, pad_id=1,
                   on_tokens=(seen := []).append)[:, ids.shape[1]:]
    for row, want in zip(got, free):
        hit = (want == eos).nonzero()
        stop = int(hit[0]) + 1 if len(hit) else len(want)
        assert torch.equal(row[:stop], want[:stop])
        assert (row[stop:] == 1).all()
    assert [list(t) for t in zip(*seen)] == got.tolist()  # streamed = returned
    with pytest.raises(ValueError, match=r"lengths \[2, 0\]"):
        pad_left([[1, 2], []])


def pp_worker(mesh, path):
    model = load_model(path, mesh)
    try:
        generate(model, PROMPT, 2)
    except ValueError as e:
        return str(e)
    return "no error"


def test_pp_is_refused_with_the_reason(run_tp, checkpoints):
    for msg in run_tp(pp_worker, 1, checkpoints["llama-t"], pp=2):
        assert msg == PP_ERROR and "pp=1" in msg


def test_byte_level_is_the_configs_to_say():
    """One rule (`ModelConfig.byte_level`): a tpkit preset or a model of no family with
    256 ids or more takes bytes; a Hugging Face import has a tokenizer of its own."""
    from dataclasses import replace

    from tpkit.spec.config import get_preset
    from tpkit.weights.families import config_from_hf

    hf = dict(model_type="llama", vocab_size=300, hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              max_position_embeddings=64)
    assert get_preset("gpt2-tiny").byte_level and GPT2.byte_level
    assert not config_from_hf(hf)[1].byte_level
    assert not replace(GPT2, vocab_size=200).byte_level
