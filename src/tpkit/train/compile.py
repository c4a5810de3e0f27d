"""`tpkit train --compile`: torch.compile of each transformer block, in place, when the
model is built (`Transformer(..., compile_backend=backend)`).

    Block: norm -> [qkv: f] -> attention core -> [out: g] -> residual -> norm -> [fc1: f]
           -> act -> [fc2: g] -> residual
           ^^^^^^^^ compiled regions between the collectives in brackets ^^^^^^^^

Every collective of `tpkit.comm` is a graph break (`torch.compiler.disable`), so the
compiled regions are the local math between them (norms, attention, activation,
residuals, dropout), and the collectives run eagerly and are recorded in the ledger
as always: the step's traffic is the theory's, compiled or not. The blocks of a stage
share their compiled code (their parameters are graph inputs), so a model compiles
once however many layers it has; training shapes are fixed, so nothing recompiles
after the first steps (`compiled_graphs` counts what Dynamo built).

With the chunked loss (`loss_chunk`), its per-chunk element-wise work over the
[c, V/tp] logits (mask, shift, exp, sums; in backward the softmax minus the target)
is compiled too, the three all-reduces between as graph breaks. The plain loss is not:
it is one autograd.Function that Dynamo cannot trace past a collective.

Compilation itself happens at the first forward.
"""

from __future__ import annotations


def compiled_graphs() -> int:
    """Graphs Dynamo has built in this process so far (grows on every recompile)."""
    from torch._dynamo.utils import counters  # lazy: Dynamo doubles a command's start

    return int(counters["stats"]["unique_graphs"])
