"""The same inputs give the same bits: `tpkit verify`'s tp=1 reference, computed the way
verify computes it (`exactness.reference`: two evaluations, a third decides if they
differ), in 4 fresh processes while two busy loops load the cores. A run to run
difference of even one bit would make verify's comparison meaningless.

Why verify evaluates twice: in a few fresh processes in a thousand on a loaded machine, a
first evaluation's loss comes out 2^-16 high (the same value every time it happens,
logits identical, every gradient moved; seen in the first wave, again on 2026-12-03 in
this test and in 1 of the 20 processes right after it, then in none of 500 more). The
causes we could force (alignment, layout, threads) are held deterministically in the
second test; what else was ruled out is in docs/benchmarks_history.md ("Determinism of verify's
reference"). A check of single first evaluations failed CI at that rate; the reference
verify uses does not (two flips in three evaluations of one process)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tpkit.layers.cross_entropy import vocab_parallel_cross_entropy
from tpkit.mesh import ParallelMesh

SRC = str(Path(__file__).resolve().parents[1] / "src")
REFERENCE = """
import hashlib
from functools import partial
import torch
from tpkit.mesh import ParallelMesh
from tpkit.model import Transformer
from tpkit.check.exactness import gather, model_case, reference
from tpkit.spec import get_preset
build = partial(Transformer, get_preset("gpt2-tiny"), seed=1, dtype=torch.float32)
opts = dict(batch=2, seq=16, sp=False)
r = reference(lambda: gather([model_case(ParallelMesh.single(), opts, build)]), print)
grads = b"".join(g.numpy().tobytes() for _, g in sorted(r["grads"].items()))
print(r["loss"].hex(), hashlib.sha256(r["out"].numpy().tobytes() + grads).hexdigest())
"""


def _busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _reference(_: int) -> str:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", REFERENCE], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]  # (a note before it: a first evaluation differed)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verifys_reference_is_bit_identical_in_4_fresh_processes_under_load():
    loops = _busy_loops(2)
    try:
        with ThreadPoolExecutor(2) as pool:
            seen = list(pool.map(_reference, range(4)))
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert len(seen) == 4 and len(set(seen)) == 1, sorted(set(seen))


def _loss_bits(logits: torch.Tensor, labels: torch.Tensor) -> str:
    """The loss (mean cross-entropy) and its gradient as hex."""
    x = logits.detach().requires_grad_(True)
    per = vocab_parallel_cross_entropy(x, labels, ParallelMesh.single().tp_group,
                                       logits.shape[-1])  # [b, s]
    loss = per.sum() / labels.numel()
    loss.backward()
    return loss.item().hex() + x.grad.numpy().tobytes().hex()


def test_loss_bits_do_not_depend_on_alignment_layout_or_threads():
    """Issue 13's candidate causes, forced: the cross-entropy + mean (and its gradient)
    on logits stored 0..31 floats into a buffer (4..124-byte alignment), strided, and
    under 1..4 threads give the same bits."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 16, 1000, generator=g) * 3  # [b, s, V]; V no multiple of 16
    labels = torch.randint(0, 1000, (2, 16), generator=g)
    want = _loss_bits(logits, labels)
    for off in range(32):
        buf = torch.empty(logits.numel() + 32)
        x = buf[off:off + logits.numel()].view_as(logits).copy_(logits)
        assert _loss_bits(x, labels) == want, f"storage offset {off} floats"
    strided = torch.empty(2, 16, 2048)[..., :1000].copy_(logits)  # rows 8 KiB apart
    assert _loss_bits(strided, labels) == want
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            assert _loss_bits(logits, labels) == want, f"{n} threads"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("odd", [0, 1, None])
def test_the_reference_takes_what_two_of_three_evaluations_agree_on(odd):
    """One evaluation of three off (the first, the second), in its loss or only in one
    gradient's last bit: verify's reference is the other two's value, and says so; two
    alike: no third evaluation, no note."""
    from tpkit.check.exactness import reference

    def result(loss: float, bump: bool = False) -> dict:
        g = torch.ones(3)
        return dict(loss=loss, out=torch.zeros(2),
                    grads={"w": torch.nextafter(g, g + 1) if bump else g})

    good = result(5.54878044128418)
    for flip in (result(5.548795700073242), result(5.54878044128418, bump=True)):
        runs = [flip if i == odd else good for i in range(3)]
        notes: list[str] = []
        got = reference(iter(runs).__next__, notes.append)
        assert got is good or (got["loss"] == good["loss"] and
                               torch.equal(got["grads"]["w"], good["grads"]["w"]))
        assert len(notes) == (odd is not None) and all("not reproducible" in n for n in notes)
