"""`tpkit verify` end to end: real processes, real comparison, exit status 0 on a match."""

from __future__ import annotations

import pytest

from tpkit.cli import main


@pytest.mark.timeout(120)
def test_verify_mlp_and_model_pass(capsys):
    assert main(["verify", "--component", "mlp", "--tp", "1,2", "--activation", "swiglu",
                 "--hidden", "32", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "OK: every tp matches tp=1" in out and "all_reduce" in out
    assert main(["verify", "--preset", "llama-tiny", "--tp", "2", "--layers", "1", "--sp",
                 "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "reduce_scatter" in out and "all_gather" in out
    # SP on 7 tokens at tp=3 (3 + 2 + 2, padded to 3 each on the wire): exact, as theory
    assert main(["verify", "--preset", "llama-tiny", "--tp", "3", "--layers", "1", "--sp",
                 "--seq", "7"]) == 0
    assert "OK: every tp matches tp=1 and the ledger matches the theory" in \
        capsys.readouterr().out


def test_verify_refuses_a_layout_the_model_does_not_admit_before_running(capsys):
    """More ranks than heads: one line naming the numbers, exit 2, no process started
    and no "MISMATCH" (a refusal is not a difference)."""
    assert main(["verify", "--preset", "gpt2-tiny", "--tp", "2,5", "--layers", "1",
                 "--seq", "8"]) == 2
    out = capsys.readouterr()
    assert "tp=5 is more than num_heads=4" in out.err and "MISMATCH" not in out.out + out.err
    assert "tpkit verify" not in out.out  # nothing ran


@pytest.mark.timeout(120)
def test_verify_runs_heads_and_widths_tp_does_not_divide(capsys):
    """gpt2-tiny's 4 heads at tp=3 (2 + 1 + 1), ffn 256 at tp=3 (86 + 85 + 85)."""
    assert main(["verify", "--preset", "gpt2-tiny", "--tp", "3", "--layers", "1",
                 "--seq", "8"]) == 0
    assert "OK: every tp matches tp=1" in capsys.readouterr().out
