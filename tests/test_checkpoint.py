"""Sharded checkpoints reshard: written at one (tp, pp), read at any other, exactly.

Math checked: a parameter (or AdamW moment) read back at any layout and gathered is
bitwise the tensor that was written (padding rows excluded); the logits of the
loaded model equal those of the tp=1 model to float32 round-off (<= 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from checkpoint_helpers import (
    GPT2,
    LLAMA,
    SMOL,
    fill,
    gather,
    local_state,
    pipeline_logits,
    random_full,
    set_grads,
)
from tpkit.checkpoint import latest
from tpkit.checkpoint import store as ckpt
from tpkit.checkpoint.rng import capture_rng, restore_rng
from tpkit.model.names import EMBED_WEIGHT
from tpkit.model.transformer import Transformer

IDS = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(0))


def save_worker(mesh, config, path, full, grads, step):
    """Random weights, one AdamW step on given gradients, save."""
    model = Transformer(config, mesh, seed=0)
    fill(model, full, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    set_grads(model, grads, mesh)
    opt.step()
    ckpt.save(path, model, opt, step=step, extra=dict(loader=dict(pos=17 + mesh.rank)),
              mesh=mesh)
    return local_state(model, mesh, opt)


def load_worker(mesh, config, path):
    """A fresh model (other seed) and optimizer; load; report state and logits."""
    model = Transformer(config, mesh, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    extra = ckpt.load(path, model, opt, mesh=mesh)
    out = local_state(model, mesh, opt)
    out.update(extra=extra, logits=pipeline_logits(model, mesh, IDS),
               lr=opt.param_groups[0]["lr"])
    return out


def reference_logits(config, full):
    from tpkit.mesh import ParallelMesh

    mesh = ParallelMesh.single()
    model = Transformer(config, mesh)
    fill(model, full, mesh)
    return pipeline_logits(model, mesh, IDS)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama-gqa", "gpt2-tied"])
@pytest.mark.parametrize("src,dsts", [((2, 2), [(1, 1), (2, 1), (1, 2), (4, 1)]),
                                      ((1, 1), [(2, 2), (4, 1)])], ids=["from22", "from11"])
def test_save_load_any_layout(run_tp, tmp_path, config, src, dsts):
    full = random_full(config, seed=1)
    grads = random_full(config, seed=2, scale=1.0)
    path = str(tmp_path / "step-3")
    saved = run_tp(save_worker, src[0], config, path, full, grads, 3, pp=src[1])
    want_params = gather(saved, config.vocab_size)
    want_opt = gather(saved, config.vocab_size, "opt")
    assert want_opt, "AdamW state was written"
    ref = reference_logits(config, {n: want_params.get(n, t) for n, t in full.items()})
    for tp, pp in dsts:
        got = run_tp(load_worker, tp, config, path, pp=pp)
        params, opt = gather(got, config.vocab_size), gather(got, config.vocab_size, "opt")
        assert params.keys() == want_params.keys()
        for n in params:
            assert torch.equal(params[n], want_params[n]), (tp, pp, n)
        assert opt.keys() == want_opt.keys()
        for n in opt:
            assert torch.equal(opt[n], want_opt[n]), (tp, pp, n)
        logits = next(r["logits"] for r in got if r["logits"] is not None)
        assert (logits - ref).abs().max().item() <= 1e-5, (tp, pp)
        assert got[0]["lr"] == 1e-2 and got[0]["extra"]["step"] == 3
        same = (tp, pp) == src
        assert [r["extra"]["loader"]["pos"] for r in got] == \
            [17 + r for r in range(len(got))] if same else got[-1]["extra"]["loader"]["pos"] == 17


@pytest.mark.timeout(120)
def test_uneven_layouts_reshard_exactly(run_tp, tmp_path):
    """9 heads / 3 kv heads, ffn 99, written at tp=2 x pp=2 (5 + 4 heads, kv 1 on both
    ranks), read at tp=3 (3 heads each) and tp=4 (3, 2, 2, 2) and tp=1: every tensor and
    AdamW moment gathered is bitwise the one written; saved again at tp=3, read at tp=2."""
    full, grads = random_full(SMOL, seed=1), random_full(SMOL, seed=2, scale=1.0)
    path, again = str(tmp_path / "step-3"), str(tmp_path / "again")
    saved = run_tp(save_worker, 2, SMOL, path, full, grads, 3, pp=2)
    want = {k: gather(saved, SMOL.vocab_size, k) for k in ("params", "opt")}
    ref = reference_logits(SMOL, {n: want["params"].get(n, t) for n, t in full.items()})
    for tp, src in ((3, path), (4, path), (1, path), (2, again)):
        got = run_tp(load_worker, tp, SMOL, src)
        for k in ("params", "opt"):
            have = gather(got, SMOL.vocab_size, k)
            assert have.keys() == want[k].keys()
            assert all(torch.equal(have[n], want[k][n]) for n in have), (tp, k)
        assert (got[0]["logits"] - ref).abs().max().item() <= 1e-5, tp
        if tp == 3:
            run_tp(resave_worker, 3, SMOL, path, again)


def resave_worker(mesh, config, path, out):
    """Load a checkpoint at this layout and save it again (same step)."""
    model = Transformer(config, mesh, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    extra = ckpt.load(path, model, opt, mesh=mesh)
    ckpt.save(out, model, opt, step=extra["step"], mesh=mesh)


@pytest.mark.timeout(60)
def test_manifest_and_files(tmp_path):
    from tpkit.mesh import ParallelMesh

    mesh = ParallelMesh.single()
    model = Transformer(LLAMA, mesh)
    rng = capture_rng()
    ckpt.save(tmp_path / "a", model, step=7, extra=dict(rng=rng), mesh=mesh)
    m = ckpt.read_manifest(tmp_path / "a")
    assert m["step"] == 7 and m["layout"] == dict(tp=1, pp=1, dp=1)
    assert m["config"] == LLAMA.to_dict()
    emb = m["tensors"][EMBED_WEIGHT]
    assert emb["logical"] == [257, 64] and emb["split"]["dim"] == 0
    qkv = m["tensors"]["layers.0.attn.qkv.weight"]
    assert qkv["split"]["parts"] == [64, 16, 16]
    assert sorted(m["files"]) == ["model-tp00-pp00.safetensors", "rank-00000.json"]
    torch.rand(3)
    extra = ckpt.load(tmp_path / "a", model, mesh=mesh)
    restore_rng(extra["rng"])
    assert torch.equal(extra["rng"]["torch"], rng["torch"])
    assert latest(tmp_path) == tmp_path / "a"
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def interleaved_worker(mesh, config, path, full, grads):
    """v=2 chunks per stage (layers 0,2 | 1,3 at pp=2): fill, one AdamW step, save, and
    the logits with the chunks chained over the ring."""
    from tpkit.comm import all_gather
    from tpkit.parallel import StageLink, ring_backward_group

    model = Transformer(config, mesh, seed=0, virtual_stages=2)
    fill(model, full, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    set_grads(model, grads, mesh)
    opt.step()
    ckpt.save(path, model, opt, step=1, mesh=mesh)
    link, logits = StageLink(mesh.pp_group, backward_group=ring_backward_group(mesh)), None
    with torch.no_grad():
        for c in range(2):  # chunk 0 of every stage, then chunk 1: the ring, once
            x = IDS if model.chunk_is_first(c) else link.recv_forward(model.activation_shape(
                *IDS.shape))
            y = model.forward_chunk(c, x)
            if model.chunk_is_last(c):
                logits = all_gather(y, mesh.tp_group, dim=-1)[..., :config.vocab_size]
            else:
                link.send_forward(y)
    link.close()
    return dict(layers=sorted(int(n.split(".")[1]) for n, _ in model.named_parameters()
                              if n.startswith("layers.")), logits=logits)


@pytest.mark.timeout(60)
def test_interleaved_checkpoint_loads_without_chunks(run_tp, tmp_path):
    full, path = random_full(GPT2, seed=3), str(tmp_path / "v2")
    grads = random_full(GPT2, seed=4, scale=1.0)
    saved = run_tp(interleaved_worker, 1, GPT2, path, full, grads, pp=2)
    assert {tuple(sorted(set(r["layers"]))) for r in saved} == {(0, 2), (1, 3)}
    want = saved[-1]["logits"]
    for pp in (2, 1):
        got = run_tp(load_worker, 1, GPT2, path, pp=pp)
        assert torch.equal(got[-1]["logits"], want), pp
