"""ModelConfig: one name per concept, its field holding the value in use.

Checked: a left-out width is derived at construction and again by `with_` when the
fields it follows change (but not by `dataclasses.replace`, which keeps values); a given
one is kept; `to_dict` / `from_dict` round-trip, and read the names that earlier
manifests used (`num_kv_heads`, `ffn_hidden`, `head_size`, `rotary_dim`, `qkv_bias`),
so a checkpoint written before the rename still loads, into the same weights.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tpkit.checkpoint import store
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.spec.config import ModelConfig, get_preset
from tpkit.spec.errors import UserError

OLD_NAMES = {"kv_heads": "num_kv_heads", "ffn": "ffn_hidden", "head_dim": "head_size",
             "rope_dim": "rotary_dim", "attn_bias": "qkv_bias"}


def test_left_out_values_are_derived_into_the_fields():
    c = ModelConfig(hidden=60, num_heads=6, bias=False)
    assert (c.kv_heads, c.ffn, c.head_dim, c.rope_dim, c.attn_bias) == (6, 240, 10, 10, False)
    assert c.derived == frozenset(OLD_NAMES)
    given = ModelConfig(hidden=64, num_heads=4, kv_heads=2, ffn=160, head_dim=32,
                        rope_dim=8, attn_bias=True, bias=False)
    assert (given.kv_heads, given.ffn, given.head_dim, given.rope_dim,
            given.attn_bias) == (2, 160, 32, 8, True)
    assert given.derived == frozenset()


def test_with_derives_again_and_replace_keeps():
    tiny = get_preset("gpt2-tiny")  # hidden 64, 4 heads: ffn 256, head_dim 16
    wider = tiny.with_(hidden=60, num_heads=6)
    assert (wider.ffn, wider.head_dim, wider.kv_heads) == (240, 10, 6)
    assert tiny.with_(hidden=60, ffn=100).ffn == 100  # given beats derived
    kept = replace(tiny, hidden=60, num_heads=6)
    assert (kept.ffn, kept.head_dim, kept.kv_heads) == (256, 16, 4)
    llama = get_preset("llama-tiny")  # kv_heads and ffn given by the preset
    assert llama.with_(hidden=128).ffn == llama.ffn == 160
    assert llama.with_(hidden=128).head_dim == 16  # 128 / 8 heads: derived again


def test_a_shape_that_cannot_be_split_is_named_not_raised_at_construction():
    c = ModelConfig(hidden=66, num_heads=4)
    assert "hidden=66 is not divisible by num_heads=4" in " ".join(c.problems())
    assert ModelConfig(hidden=66, num_heads=4, head_dim=16).problems() == []
    assert "num_heads=0 must be positive" in " ".join(ModelConfig(num_heads=0).problems())


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny", "llama3-405b"])
def test_dict_round_trip_and_the_earlier_names(name):
    c = get_preset(name)
    d = c.to_dict()
    assert "derived" not in d and all(v is not None for k, v in d.items() if k in OLD_NAMES)
    assert ModelConfig.from_dict(json.loads(json.dumps(d))) == c
    old = {OLD_NAMES.get(k, k): (None if k in c.derived else v) for k, v in d.items()}
    assert ModelConfig.from_dict(old) == c
    with pytest.raises(UserError, match=r"unknown ModelConfig fields: \['hiden'\]"):
        ModelConfig.from_dict({**d, "hiden": 3})


def test_a_checkpoint_with_the_earlier_names_loads(tmp_path):
    mesh, cfg = ParallelMesh.single(), get_preset("llama-tiny")
    model = Transformer(cfg, mesh, seed=1)
    store.save(tmp_path / "ckpt", model, step=3, mesh=mesh)
    path = tmp_path / "ckpt" / store.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["config"] = {OLD_NAMES.get(k, k): (None if k in cfg.derived else v)
                          for k, v in manifest["config"].items()}
    path.write_text(json.dumps(manifest))
    again = Transformer(cfg, mesh, seed=2)
    store.load(tmp_path / "ckpt", again, mesh=mesh)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    other = Transformer(cfg.with_(ffn=192), mesh, seed=2)
    with pytest.raises(store.CheckpointError, match="ffn=160 in the checkpoint, 192 in"):
        store.load(tmp_path / "ckpt", other, mesh=mesh)
