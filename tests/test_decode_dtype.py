"""Decoding in a lower dtype and without padding (the default), against transformers.

Math checked: bfloat16 greedy tokens of the serving engine equal transformers' own
bfloat16 greedy tokens, at tp=1 and tp=2, up to the first near-tie. bfloat16 keeps 8
significant bits (rounding unit u = 2^-8, relative); tpkit and transformers round at
different places (transformers' RMSNorm and softmax upcast, its rotary angles are cast
to bfloat16, tpkit's rotary runs in float32; at tp=2 the all-reduce sums two bfloat16
halves), so their logits differ from float32's by a few percent of the largest logit
on this 4-layer random model (transformers': 0.2-0.5 on logits up to 6.8, i.e. 8-21
u of it). Two argmaxes of logits each within e of float32's pick tokens whose float32
logits are within 2e, so where the two greedy texts part, the test states the three
margins between the two tokens (tpkit's, transformers', float32's) and bounds each by
B = 32 u of the largest float32 logit (0.8 here): a divergence is a near-tie, never a
wrong computation (a slot off by one parts at the first token by whole logits).
At float32 nothing changes: the default (the running rows, no padding) gives the
batch-invariant mode's greedy tokens, and a lone client's decode is a [1, 1] forward.
"""

from __future__ import annotations

import pytest
import torch

from hf_folders import tiny_llama_folder
from tpkit.cli import main
from tpkit.mesh import ParallelMesh
from tpkit.serve import Engine, SamplingParams
from tpkit.serve.runner import Runner
from tpkit.weights.sources import load_model, open_source

PROMPTS = [[1, 40, 7, 150], [1, 9], [1, 200, 31, 31, 77, 5], [1, 120, 64]]
NEW, TOP, U = 16, 5, 2.0 ** -8  # tokens per prompt, log-probs kept, bfloat16's unit


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random Llama with wide weights (logits of a few units: real margins)."""
    return tiny_llama_folder(tmp_path_factory.mktemp("dtype") / "llama", initializer_range=0.3)


def engine_worker(mesh, path, dtype, chunk=None):
    """Rank 0: each prompt's greedy tokens and top-5 log-probs through the engine (the
    model decode-only, as generate and serve load it: bfloat16 weights packed)."""
    model = load_model(open_source(path), mesh, dtype=dtype, decode=True)
    if mesh.tp_rank != 0:
        return Runner(model).follow()
    engine = Engine(model, max_batch=4, max_len=64, decode_chunk=chunk)
    reqs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                   logprobs=TOP))
    out = [(r.tokens, [dict(t) for t in r.top]) for r in reqs]
    engine.runner.lead_stop()
    return out


def _hf(path, dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' bfloat16 greedy tokens and logits [NEW, V] of each prompt (once)."""
    hb, out = _hf(folder, torch.bfloat16), []
    for prompt in PROMPTS:
        with torch.no_grad():
            o = hb.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                            do_sample=False, output_logits=True, return_dict_in_generate=True)
        out.append((o.sequences[0, len(prompt):].tolist(), torch.cat(o.logits).float()))
    return out


def _check_against_transformers(path, reference, got):
    """Each prompt: tokens equal transformers' bfloat16 greedy ones, or the first
    divergence is a near-tie (module docstring); returns the margins seen."""
    h32, same, seen = None, 0, []
    for prompt, (want, logits), (tokens, tops) in zip(PROMPTS, reference, got):
        i = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), NEW)
        same += i
        if i == NEW:
            continue
        a, b = tokens[i], want[i]  # ours, transformers'
        h32 = h32 or _hf(path, torch.float32)
        with torch.no_grad():
            l32 = h32(torch.tensor([prompt + want[:i]])).logits[0, -1]  # [V]
        bound = 32 * U * l32.abs().max().item()
        margins = dict(step=i, tpkit=tops[i][a] - tops[i].get(b, float("-inf")),
                       transformers=(logits[i, b] - logits[i, a]).item(),
                       float32=(l32[a] - l32[b]).item())
        seen.append(margins)
        assert b in tops[i], (prompt, margins)  # transformers' token is a contender of ours
        assert max(abs(m) for k, m in margins.items() if k != "step") <= bound, \
            (prompt, margins, bound)
    assert same >= NEW * len(PROMPTS) // 2, (same, seen)  # mostly the same text
    return seen


def test_bf16_greedy_tokens_equal_transformers_bf16_at_tp1_and_tp2(run_tp, folder, reference):
    for tp in (1, 2):
        got = run_tp(engine_worker, tp, str(folder), torch.bfloat16)[0]
        _check_against_transformers(folder, reference, got)


def test_float32_default_decodes_the_running_rows_only(folder, monkeypatch):
    """One client: each decode forward is [1, 1] (not a chunk of 8); the greedy tokens and
    log-probs of the default equal the batch-invariant mode's (margins are wide here)."""
    invariant = engine_worker(ParallelMesh.single(), str(folder), torch.float32, 8)
    default = engine_worker(ParallelMesh.single(), str(folder), torch.float32)
    assert [t for t, _ in default] == [t for t, _ in invariant]
    for (_, a), (_, b) in zip(default, invariant):
        assert max(abs(x[k] - y[k]) for x, y in zip(a, b) for k in x) < 1e-4
    model = load_model(open_source(folder), ParallelMesh.single())
    shapes = []
    model.layers["0"].register_forward_pre_hook(lambda m, args: shapes.append(args[0].shape))
    for chunk, rows in ((None, 1), (8, 4)):  # invariant: every slot of the pool of 4
        shapes.clear()
        Engine(model, max_batch=4, max_len=64, decode_chunk=chunk).generate(
            [PROMPTS[0]], SamplingParams(max_tokens=4))
        # a row per token (the paged cache's layout): the prompt's 4, then the decodes
        assert [tuple(s) for s in shapes] == [(4, 1, 64)] + [(rows, 1, 64)] * 3, chunk


def test_dtype_and_batch_invariant_flags(folder, capsys):
    """`tpkit generate`: --dtype float32 is the default's text; --dtype bfloat16 runs;
    --decode-chunk without --batch-invariant is one line, exit 2."""
    base = ["generate", "--checkpoint", str(folder), "--prompt-ids", "1,40,7", "--max-new-tokens",
            "6"]
    texts = []
    for extra in ([], ["--dtype", "float32"], ["--batch-invariant"], ["--dtype", "bfloat16"]):
        assert main(base + extra) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] and len(texts[3].split()) == 6
    assert main(base + ["--decode-chunk", "2"]) == 2
    assert "tpkit generate: error: --decode-chunk=2 needs --batch-invariant" in \
        capsys.readouterr().err


@pytest.mark.timeout(180)
def test_verify_hf_in_bfloat16_against_transformers_in_bfloat16(tmp_path, capsys):
    """`tpkit verify --hf DIR --dtype bfloat16`: both sides in bfloat16, the bound in
    bfloat16 rounding units in the table's header (measured here: ~2 units)."""
    folder = tiny_llama_folder(tmp_path / "llama")  # transformers' own initialization
    assert main(["verify", "--hf", str(folder), "--tp", "1,2", "--dtype", "bfloat16",
                 "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16, tp=[1, 2], reference: transformers in bfloat16" in out
    assert "<= 16 bfloat16 rounding units (2^-8) = 0.0625" in " ".join(out.split())
    assert "OK: every tp matches transformers" in out


def greedy_worker(mesh, path):
    """Rank 0: greedy requests of different lengths, one through a block boundary, one
    ending first (the plans change); the others follow: (steps, steps readied)."""
    model = load_model(open_source(path), mesh, dtype=torch.float32, decode=True)
    runner = Runner(model)
    if mesh.tp_rank != 0:
        return runner.follow(), runner.expected
    engine = Engine(model, max_batch=4, max_len=64, runner=runner)
    reqs = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(PROMPTS, (20, 5, 12, 9))]
    while engine.busy:
        engine.step()
    engine.runner.lead_stop()
    return [(r.tokens, r.logprobs) for r in reqs]


def test_followers_ready_the_step_they_expect_and_run_any_other(run_tp, folder):
    """At tp=2 the follower readies the greedy step it expects while rank 0 plans it
    (`Runner._expect`): most decode steps run readied, and where the plan is another (a
    request ended, a row needs a new block, a prompt arrives) it runs the plan sent; the
    tokens are tp=1's and the log-probabilities tp=1's to float32 round-off."""
    one = run_tp(greedy_worker, 1, str(folder))[0]
    lead, (steps, readied) = run_tp(greedy_worker, 2, str(folder))
    assert [t for t, _ in lead] == [t for t, _ in one]
    assert max(abs(a - b) for (_, x), (_, y) in zip(lead, one) for a, b in zip(x, y)) < 1e-4
    # 20 steps: the prompts' prefill, then 19 of decode rows alone; not expected: the
    # first after the prefill, those after a request ended (3), those where the rows of
    # the 4- and 6-token prompts start a second block of 16 (2): 7 at most
    assert steps == 20 and steps - 7 <= readied < steps, (readied, steps)
