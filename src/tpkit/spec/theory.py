"""What each layer must send: the communication theory the ledger is held to.

Per transformer layer and micro-batch, with activations [b, s, h] and tp > 1
(Shoeybi et al. 2019; Korthikanti et al. 2022):

    attention:  1 all-reduce of b*s*h forward (after out-proj), 1 backward (before qkv)
    MLP:        1 all-reduce of b*s*h forward (after fc2),      1 backward (before fc1)
                (a mixture of experts too: the experts' partial outputs are summed on
                each rank before that one all-reduce, whatever the number of experts)
    with sequence parallelism, each all-reduce becomes 1 reduce-scatter + 1 all-gather
    of the same b*s*h elements (the same bytes on the wire).
    vocab-parallel embedding: 1 all-reduce of b*s*h forward (or a reduce-scatter with SP)
    vocab-parallel cross-entropy: 3 all-reduces of b*s forward (max, target, sum-exp)

A list of `Expect` is what `Ledger.compare` checks against.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Expect:
    """`count` collectives `op` of `numel` elements each, in `phase`."""

    op: str
    phase: str
    numel: int
    count: int = 1


def as_counter(expects: list[Expect]) -> Counter:
    """(op, phase, numel) -> count, summed over the list."""
    c: Counter = Counter()
    for e in expects:
        c[(e.op, e.phase, e.numel)] += e.count
    return c


def parallel_block(b: int, s: int, h: int, tp: int, sp: bool = False) -> list[Expect]:
    """A column-parallel -> row-parallel block (the MLP, or attention)."""
    if tp == 1:
        return []
    n = b * s * h
    if sp:
        return [Expect("all_gather", "forward", n), Expect("reduce_scatter", "forward", n),
                Expect("all_gather", "backward", n), Expect("reduce_scatter", "backward", n)]
    return [Expect("all_reduce", "forward", n), Expect("all_reduce", "backward", n)]


def mlp(b: int, s: int, h: int, tp: int, sp: bool = False) -> list[Expect]:
    """The Megatron MLP: one all-reduce forward, one backward (or their SP halves)."""
    return parallel_block(b, s, h, tp, sp)


def column_column_mlp(b: int, s: int, h: int, ffn: int, tp: int) -> list[Expect]:
    """Both matrices split by columns (quiz answer 2's wrong option): fc1's output must
    be all-gathered before fc2 can use it (b*s*ffn), fc2's output gathered again
    (b*s*h), and backward both replicated inputs need their gradients all-reduced."""
    if tp == 1:
        return []
    return [Expect("all_gather", "forward", b * s * ffn), Expect("all_gather", "forward", b * s * h),
            Expect("all_reduce", "backward", b * s * ffn), Expect("all_reduce", "backward", b * s * h)]


def attention(b: int, s: int, h: int, tp: int, sp: bool = False) -> list[Expect]:
    """Heads split over tp: the same traffic as the MLP."""
    return parallel_block(b, s, h, tp, sp)


def layer(b: int, s: int, h: int, tp: int, sp: bool = False) -> list[Expect]:
    """One transformer layer: attention + MLP."""
    return attention(b, s, h, tp, sp) + mlp(b, s, h, tp, sp)


def embedding(b: int, s: int, h: int, tp: int, sp: bool = False) -> list[Expect]:
    """Vocab-parallel embedding: the masked partial lookups are summed once (with SP a
    reduce-scatter, whose conjugate all-gathers the gradient back for the table)."""
    if tp == 1:
        return []
    if sp:
        return [Expect("reduce_scatter", "forward", b * s * h),
                Expect("all_gather", "backward", b * s * h)]
    return [Expect("all_reduce", "forward", b * s * h)]


def head(b: int, s: int, h: int, tp: int, sp: bool = False) -> list[Expect]:
    """The vocab-parallel output layer: its input's gradient is all-reduced (f), or with
    SP the input is all-gathered forward and its gradient reduce-scattered."""
    if tp == 1:
        return []
    if sp:
        return [Expect("all_gather", "forward", b * s * h),
                Expect("reduce_scatter", "backward", b * s * h)]
    return [Expect("all_reduce", "backward", b * s * h)]


def stage(b: int, s: int, h: int, tp: int, sp: bool, num_layers: int, *, first: bool = True,
          last: bool = True) -> list[Expect]:
    """Tensor-parallel traffic of one micro-batch through a pipeline stage holding
    `num_layers` layers (the whole model when first and last)."""
    out = embedding(b, s, h, tp, sp) if first else []
    out += layer(b, s, h, tp, sp) * num_layers
    if last:
        out += head(b, s, h, tp, sp) + cross_entropy(b, s, tp)
    return out


def cross_entropy(b: int, s: int, tp: int) -> list[Expect]:
    """Vocab-parallel cross-entropy: max, target logit and sum of exp, b*s each."""
    if tp == 1:
        return []
    return [Expect("all_reduce", "forward", b * s, count=3)]
