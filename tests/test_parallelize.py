"""`tpkit.parallelize(module, mesh, plan)` on a module tpkit has no family for.

Checked: at tp=2 the parallelized module's output and every gradient (gathered from the
shards by their split tags) equal the unsharded module's to float32 round-off (relative);
the ledger holds exactly the collectives the plan implies (forward: one all-reduce per
vocab and per rowwise module, backward: one per colwise); a plan that cannot work is one
UserError line naming the module or pattern, before any module is swapped;
docs/python.md's example runs as it stands there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import gather_grads, local_grads, splits_of
from tpkit.comm.group import CommGroup
from tpkit.parallel.parallelize import parallelize
from tpkit.spec.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
VOCAB, H, FFN, B, S = 13, 8, 16, 2, 5  # 13: the vocabulary is padded to 16 at tp=2
PLAN = {"embed": "vocab", "*.up": "colwise", "*.down": "rowwise", "gate": "colwise",
        "out": "rowwise", "norm": "replicated"}


class Block(nn.Module):
    def __init__(self, ffn: int = FFN):
        super().__init__()
        self.up, self.down = nn.Linear(H, ffn), nn.Linear(ffn, H, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Tiny(nn.Module):
    """An embedding, two MLP blocks, a gated MLP without biases, a norm."""

    def __init__(self, ffn: int = FFN):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.blocks = nn.ModuleList([Block(ffn), Block(ffn)])
        self.gate, self.out = nn.Linear(H, FFN, bias=False), nn.Linear(FFN, H)
        self.norm = nn.LayerNorm(H)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x + self.out(torch.sigmoid(self.gate(x))))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (B, S), generator=g), torch.randn(B, S, H, generator=g)


def _on_rank(mesh, ids, gy):
    torch.manual_seed(0)
    model = parallelize(Tiny(), mesh, PLAN)
    mesh.ledger.clear()
    y = model(ids)
    y.backward(gy)
    return dict(y=y.detach(), grads=local_grads(model), splits=splits_of(model),
                counts=mesh.ledger.counts(), names=[type(m).__name__ for m in model.modules()])


def _implied(model: nn.Module) -> Counter:
    """What PLAN sends on each rank: (op, phase, elements) -> times."""
    want = Counter()
    for name, m in model.named_modules():
        if name in ("embed", "out") or name.endswith(".down"):  # vocab, rowwise
            want[("all_reduce", "forward", B * S * H)] += 1
        if name == "gate" or name.endswith(".up"):  # colwise: dx of its input
            want[("all_reduce", "backward", B * S * m.in_features)] += 1
    return want


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.timeout(120)
def test_a_plan_is_exact_and_sends_what_it_implies(run_tp):
    ids, gy = _inputs()
    torch.manual_seed(0)
    ref = Tiny()
    y = ref(ids)
    y.backward(gy)
    per_rank = run_tp(_on_rank, 2, ids, gy)
    assert "ColumnParallelLinear" in per_rank[0]["names"]
    for r in per_rank:
        assert _rel(r["y"], y.detach()) < 1e-6
        assert r["counts"] == _implied(ref)
    grads = gather_grads([r["grads"] for r in per_rank], per_rank[0]["splits"])
    embed = grads["embed.weight"]
    assert embed.shape == (16, H) and not embed[VOCAB:].any()  # padding: no id reaches it
    grads["embed.weight"] = embed[:VOCAB]
    assert grads.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        assert _rel(grads[name], p.grad) < 1e-5, name


def _tied() -> nn.Module:
    model = Tiny()
    model.gate.weight = model.blocks[0].up.weight
    return model


@pytest.mark.parametrize("model,plan,error", [
    (Tiny, {"*.fc1": "colwise"}, r"plan entry '\*\.fc1' matches no module of Tiny "
                                 r"\(its modules: embed, blocks, blocks\.0"),
    (Tiny, {"gate": "columnwise"}, r"'gate' has style 'columnwise', not one of colwise, "
                                   r"rowwise, vocab, replicated"),
    (Tiny, {"gate": "colwise", "norm": "colwise"}, r"^parallelize: norm is a LayerNorm; "
                                                   r"colwise takes an nn\.Linear$"),
    (Tiny, {"*.up": "rowwise", "blocks": "vocab"}, r"blocks is a ModuleList; vocab takes "
                                                   r"an nn\.Embedding"),
    (lambda: Tiny(ffn=15), {"gate": "colwise", "*.up": "colwise"},
     r"^parallelize: blocks\.0\.up \(colwise\) has out_features=15, which tp=2 does not "
     r"divide$"),
    (lambda: Tiny(ffn=15), {"*.down": "rowwise"}, r"blocks\.0\.down \(rowwise\) has "
                                                  r"in_features=15, which tp=2"),
    (Tiny, {"*.up": "colwise", "blocks.1.*": "rowwise"},
     r"blocks\.1\.up is colwise by '\*\.up' and rowwise by 'blocks\.1\.\*'"),
    (_tied, {"gate": "colwise"}, r"gate\.weight is tied to blocks\.0\.up\.weight"),
])
def test_a_plan_that_cannot_work_is_one_line_naming_the_module(model, plan, error):
    two = CommGroup("tp", (0, 1), 0)  # refused before any collective: no process group
    m = model()
    with pytest.raises(UserError, match=error):
        parallelize(m, two, plan)
    assert {type(x) for x in m.modules()} <= {Tiny, Block, nn.ModuleList, nn.Linear,
                                              nn.Embedding, nn.LayerNorm}  # nothing swapped


def test_an_embedding_option_it_cannot_keep_and_a_foreign_mesh_are_refused():
    m = Tiny()
    m.embed.padding_idx = 0
    with pytest.raises(UserError, match=r"embed has padding_idx=0, which the vocab-parallel"):
        parallelize(m, CommGroup("tp", (0, 1), 0), {"embed": "vocab"})
    with pytest.raises(UserError, match=r"mesh is a str; give the ParallelMesh that "
                                        r"tpkit.spawn passes"):
        parallelize(m, "tp", {"gate": "colwise"})


def _example() -> str:
    text = (ROOT / "docs" / "python.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S)
                if "tpkit.parallelize" in b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_docs_example_runs_as_pasted(tmp_path):
    (tmp_path / "mixer.py").write_text(_example())
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, str(tmp_path / "mixer.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 x all_reduce of 2048 elements (backward)" in out.stdout  # 4 colwise layers
    assert "5 x all_reduce of 2048 elements (forward)" in out.stdout  # vocab + 4 rowwise
