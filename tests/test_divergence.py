"""The silent-divergence guard: a replicated parameter perturbed on one tp rank (one
float32 ulp of one element) is caught, naming the parameter, the rank and the step;
untouched replicas pass."""

from __future__ import annotations

import pytest

from tpkit.parallel.divergence import ReplicaMismatch, check_replicas


def _guard(mesh, perturb: str | None, rank: int):
    import torch

    from tpkit.model import Transformer
    from tpkit.spec import get_preset

    model = Transformer(get_preset("gpt2-tiny"), mesh, seed=3)
    if perturb and mesh.rank == rank:
        with torch.no_grad():
            w = dict(model.named_parameters())[perturb]
            w.view(-1)[5] = torch.nextafter(w.view(-1)[5], torch.tensor(9.0))
    try:
        check_replicas(model, mesh.tp_group, step=7)
    except ReplicaMismatch as e:
        return str(e)
    return None


@pytest.mark.timeout(300)  # may start the 2-rank pool: 57 s at load 20
def test_a_perturbed_replica_is_caught(run_tp):
    assert run_tp(_guard, 2, None, 0) == [None, None]
    said = run_tp(_guard, 2, "layers.1.mlp_norm.weight", 1)
    assert said[0] == said[1] and said[0] is not None
    assert said[0].startswith("step 7: replicated parameter 'layers.1.mlp_norm.weight'")
    assert "ranks [1] disagree with rank 0" in said[0]
