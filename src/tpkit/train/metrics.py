"""What one step of a stage must send, for the end-of-run comparison with the ledger.

The run's logging lives in `tpkit.train.run_log`, its report in `tpkit.train.report`.
"""

from __future__ import annotations


def stage_theory(hidden: int, b: int, s: int, tp: int, pp: int, sp: bool, m: int,
                 first: bool, last: bool, num_layers: int, chunks: int = 1) -> list:
    """What one step must send on this rank's tp and pp groups (tpkit.spec.theory).

    Per micro-batch: `theory.stage` (embedding on the first stage, 2+2 per layer,
    head and the three cross-entropy all-reduces on the last); and between stages
    one activation forward and its gradient backward, [b, s, h] ([b, s/tp, h] with SP),
    per chunk of the stage (interleaved), except out of the very last chunk and into
    the very first one.
    """
    from tpkit.spec import theory

    one = theory.stage(b, s, hidden, tp, sp, num_layers, first=first, last=last)
    act = b * (s // tp if sp else s) * hidden
    out, into = chunks - last, chunks - first  # activations leaving / entering the stage
    if pp > 1 and out:
        one += [theory.Expect("send", "forward", act, out),
                theory.Expect("recv", "backward", act, out)]
    if pp > 1 and into:
        one += [theory.Expect("recv", "forward", act, into),
                theory.Expect("send", "backward", act, into)]
    return [theory.Expect(e.op, e.phase, e.numel, e.count * m) for e in one]
