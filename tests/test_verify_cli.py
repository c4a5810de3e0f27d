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


def test_verify_reports_a_layout_the_model_does_not_admit(capsys):
    assert main(["verify", "--preset", "gpt2-tiny", "--tp", "3", "--layers", "1",
                 "--seq", "8"]) == 1
    assert "num_heads=4 is not divisible by tp=3" in capsys.readouterr().out
