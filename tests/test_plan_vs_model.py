"""The planner's memory model (pure Python) against real tpkit models on the meta device:
per-rank parameter counts must agree exactly at every layout the model admits."""

from __future__ import annotations

import pytest

from tpkit.mesh import ParallelMesh
from tpkit.model import Transformer
from tpkit.plan import params_per_rank
from tpkit.spec import get_preset


@pytest.mark.parametrize("preset,tp,pp", [("gpt2-124m", 4, 2), ("llama2-7b", 8, 4),
                                          ("llama3-70b", 8, 8), ("llama-tiny", 4, 2),
                                          ("gpt2-tiny", 2, 2), ("bert-tiny", 4, 1)])
def test_params_per_rank_equal_the_meta_model(preset, tp, pp):
    cfg = get_preset(preset)
    for stage in range(pp):
        mesh = ParallelMesh.virtual(tp=tp, pp=pp, rank=stage * tp)
        model = Transformer(cfg, mesh, device="meta")
        real = sum(p.numel() for p in model.parameters())
        assert params_per_rank(cfg, tp, pp, stage) == real, (preset, tp, pp, stage)
