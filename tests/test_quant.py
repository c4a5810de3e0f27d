"""Weight-only int8 (`tpkit.decode.forms`, `--quantize int8`).

Math checked: each weight row becomes q * scale with q = round(w / scale) in
[-127, 127] and scale = max |w_row| / 127 (rounded to bfloat16), so |q * scale - w| is
at most one step (half a step, plus the bfloat16 rounding of the scale) per row; the
product is x (rounded to bfloat16) times that dequantized matrix, to float accumulation
and one bfloat16 rounding of the output (2^-8 relative). Sharded, every rank holds tp=1's
int8 values of its slice (a row-parallel layer takes its rows' maximum over the group),
so the model's int8 values are the same at any tp. Its logits are not bit for bit: the
kernel rounds each rank's partial product to bfloat16 before the all-reduce sums them
(tp=1 rounds the whole sum once), so tp=2 and tp=1 differ as bfloat16 models do: by a
few units of 2^-8 of the largest logit (about 6 on these random models), bounded by 16
as `tpkit verify --dtype bfloat16` bounds bfloat16 against transformers; and each stays
within 16 units of the float model's logits.
"""

from __future__ import annotations

import pytest
import torch

from hf_folders import SMOL, tiny_llama_folder
from tpkit.cli import main
from tpkit.comm import all_gather
from tpkit.decode.forms import Int8Weight
from tpkit.layers.sharding import shard
from tpkit.weights.sources import load_model, open_source

PROMPT = [1, 40, 7, 150, 9, 31]
U = 2.0 ** -8  # bfloat16's rounding unit: the product's activations and output are bfloat16


@pytest.mark.parametrize("k", [64, 72])  # the int8 kernel (k % 16 == 0), and the fallback
def test_int8_weight_is_the_rounded_weight_and_its_product(k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(37, k, generator=g) * torch.rand(37, 1, generator=g)  # rows of all sizes
    q8 = Int8Weight.of(w)
    assert q8.fast == (k % 16 == 0) and q8.q.dtype == torch.int8
    scale = (w.abs().amax(1) / 127).to(torch.bfloat16).float()
    assert torch.equal(q8.scale.float(), scale)
    assert torch.equal(q8.q.float(), torch.round(w / scale[:, None]).clamp(-127, 127))
    step = (q8.dequantized() - w).abs().amax(1) / scale  # in steps of each row
    assert step.max() <= 1.0 and step.max() > 0.3  # rounded, not truncated nor exact
    x = torch.randn(3, 5, k, generator=g)
    want = x.to(torch.bfloat16).float() @ q8.dequantized().t()
    got = q8(x)
    assert got.shape == (3, 5, 37) and got.dtype == torch.float32
    assert ((got - want).abs().max() / want.abs().max()) <= 2.0 ** -7


def _quantized(mesh, path):
    """Full logits of the int8 and the float model, and every int8 layer's values."""
    ids = torch.tensor([PROMPT])
    out = {}
    for how in ("int8", None):
        model = load_model(open_source(path), mesh, quantize=how)
        with torch.no_grad():
            out[how] = all_gather(model.logits(model.body(ids)), model.group, dim=-1)
    qs = {}
    model = load_model(open_source(path), mesh, quantize="int8")
    for n, m in model.named_modules():
        if getattr(m, "int8", None) is not None:
            qs[n] = (m.decoding.q, m.split)
    V = model.config.vocab_size
    qs["head"] = (model.head_decoding.q, V)
    return out["int8"][..., :V], out[None][..., :V], qs


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["llama", "smol"])
def test_int8_at_tp2_holds_tp1s_values_and_gives_its_logits(tmp_path, pools, shape):
    path = tiny_llama_folder(tmp_path / shape, initializer_range=0.3,
                             **(SMOL if shape == "smol" else {}))
    (q1, f1, one), = pools.run(_quantized, 1, path, mesh=dict(tp=1))
    ranks = pools.run(_quantized, 2, path, mesh=dict(tp=2))
    for r, (q2, _, two) in enumerate(ranks):
        assert two.keys() == one.keys()
        for name, (q, split) in two.items():
            full = one[name][0]
            if name == "head":  # vocabulary rows split evenly (padding past V = split)
                first = r * q.shape[0]
                n = min(q.shape[0], split - first)
                assert torch.equal(q[:n], full[first:first + n]), r
            else:
                assert torch.equal(q, shard(full, split, r, 2)), (name, r)
        apart = (q2 - q1).abs().max() / f1.abs().max()
        assert apart <= 16 * U, (r, apart / U)  # bfloat16's rounding, elsewhere at tp=2
    err = (q1 - f1).abs().max() / f1.abs().max()  # int8's cost on this model's logits
    assert 0.1 * U < err < 16 * U, err / U


@pytest.mark.slow
def test_generate_takes_quantize_int8_at_tp2(tmp_path, capsys):
    path = tiny_llama_folder(tmp_path / "llama")
    ids = ",".join(map(str, PROMPT))
    for tp in ("1", "2"):
        assert main(["generate", "--checkpoint", str(path), "--prompt-ids", ids, "--quantize",
                     "int8", "--max-new-tokens", "4", "--ignore-eos", "--tp", tp]) == 0
    out = capsys.readouterr()
    lines = [ln for ln in out.out.splitlines() if ln.strip()]
    assert len(lines) == 2 and all(len(ln.split()) == 4 for ln in lines), out.out
    assert lines[0] == lines[1], out.out  # the followers load int8 too: tp=1's tokens
