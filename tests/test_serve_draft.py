"""Draft-model speculative decoding (`serve.draft`): a tiny draft with the target's
vocabulary (the target's first 3 of 4 layers: early-exit self-speculation, so some of
its proposals are accepted and some not) proposes, the target verifies; greedy tokens
and log-probabilities are bit for bit those without speculation at tp=1 and tp=2, the
draft's KV blocks are freed when the requests end; a draft with another vocabulary is
refused in one line, on the CLI too.
"""

from __future__ import annotations

import pytest
import torch

from checkpoint_helpers import LLAMA, fill, random_full
from helpers import generate_args
from tpkit.checkpoint import store as ckpt
from tpkit.commands.generate import run
from tpkit.decode.forms import for_decode
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.serve import Engine, SamplingParams
from tpkit.serve.draft import Draft, DraftSpeculator, check_vocabulary
from tpkit.serve.runner import Runner
from tpkit.spec.errors import UserError

CONFIG = LLAMA.with_(max_seq_len=128)
SHARED = torch.randint(0, 257, (33,), generator=torch.Generator().manual_seed(3)).tolist()
PROMPTS = [SHARED + [5, 9], SHARED + [7], [1, 2, 3], SHARED[:20]]
NEW = [24, 3, 24, 24]


def _models(mesh, dtype=torch.float32, layers: int = 3, decode: bool = True):
    """The target (4 layers, on `mesh`) and a draft at tp=1: its first `layers` layers
    (`decode`: in their decoding form)."""
    full = random_full(CONFIG, seed=5, scale=1.0)
    target = Transformer(CONFIG, mesh)
    fill(target, full, mesh)
    one, cut = ParallelMesh.single(), CONFIG.with_(num_layers=layers)
    draft = Transformer(cut, one)
    fill(draft, {k: v for k, v in full.items()
                 if not k.startswith("layers.") or int(k.split(".")[1]) < layers}, one)
    if not decode:
        return target, draft
    return for_decode(target.to(dtype)), for_decode(draft.to(dtype))


def _run(engine, together: bool):
    groups = [list(range(len(PROMPTS)))] if together else [[i] for i in range(len(PROMPTS))]
    out = []
    for group in groups:
        reqs = [engine.submit(PROMPTS[i], SamplingParams(max_tokens=NEW[i], logprobs=1))
                for i in group]
        while engine.busy:
            engine.step()
        out += [(r.tokens, r.logprobs, r.top) for r in reqs]
    return out


def draft_worker(mesh, dtype, ways=(False, True)):
    """Rank 0: every prompt alone, or together (`ways`), without and with the draft;
    followers run the target's steps. [(reference, speculated, proposed, accepted)]."""
    target, draft_model = _models(mesh, dtype)
    runner = Runner(target)
    if mesh.tp_rank != 0:
        return runner.follow()
    got = []
    for together in ways:
        ref = _run(Engine(target, max_batch=8, runner=runner), together)
        spec = DraftSpeculator(Draft(draft_model, 8, 128), tokens=4, row_cost=0.0)
        engine = Engine(target, max_batch=8, runner=runner, speculator=spec)
        got.append((ref, _run(engine, together), spec.proposed, spec.accepted))
        spec.draft.keep(set())
        assert spec.draft.pool.in_use == 0
    runner.lead_stop()
    return got


def _check(got):
    for ref, spec, proposed, accepted in got:
        assert spec == ref  # tokens, log-probabilities, top: bit for bit
        assert 0 < accepted < proposed  # accepted and rejected proposals both ran


@pytest.mark.timeout(120)
def test_draft_speculation_keeps_the_targets_tokens():
    _check(draft_worker(ParallelMesh.single(), torch.float32, (False,)))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_draft_speculation_keeps_the_targets_tokens_at_tp2(run_tp):
    _check(run_tp(draft_worker, 2, torch.bfloat16, (True,))[0])


def test_generate_cli_with_a_draft_and_one_with_another_vocabulary(tmp_path, capsys):
    """`tpkit generate --speculative draft --draft-checkpoint`: the same text as without,
    the acceptance printed; a draft of another vocabulary refused in one line."""
    target, draft = _models(ParallelMesh.single(), decode=False)
    check_vocabulary(target, draft)
    other = Transformer(CONFIG.with_(vocab_size=300), ParallelMesh.single())
    with pytest.raises(UserError, match="the draft's vocabulary has 300 tokens, the "
                                        "target's 257"):
        check_vocabulary(target, other)
    mesh = ParallelMesh.single()
    for name, model in (("target", target), ("draft", draft), ("other", other)):
        ckpt.save(tmp_path / name, model, mesh=mesh)
    ids = ",".join(map(str, SHARED * 2))
    outs = []
    for spec in ([], ["--speculative", "draft", "--draft-checkpoint", str(tmp_path / "draft")]):
        assert run(generate_args("--checkpoint", str(tmp_path / "target"), "--prompt-ids",
                                 ids, "--max-new-tokens", "24", *spec)) == 0
        outs.append(capsys.readouterr())
    assert outs[0].out == outs[1].out  # the same tokens
    assert " proposed token" in outs[1].err and " accepted" in outs[1].err
    with pytest.raises(UserError, match="vocabulary has 300 tokens"):
        run(generate_args("--checkpoint", str(tmp_path / "target"), "--prompt-ids", ids,
                          "--speculative", "draft", "--draft-checkpoint",
                          str(tmp_path / "other")))
    with pytest.raises(UserError, match="--draft-checkpoint=.*nowhere: no such file"):
        run(generate_args("--checkpoint", str(tmp_path / "target"), "--prompt-ids", ids,
                          "--speculative", "draft", "--draft-checkpoint",
                          str(tmp_path / "nowhere")))
    with pytest.raises(UserError, match="--speculative draft needs --draft-checkpoint"):
        run(generate_args("--checkpoint", str(tmp_path / "target"), "--prompt-ids", ids,
                          "--speculative", "draft"))
