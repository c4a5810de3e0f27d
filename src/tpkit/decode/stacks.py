"""A model's decode forward on the native stack, decided once per model: every layer in
one native call (`native.NativeStack`), and for a greedy step of decode rows the
embedding, the layers, the final norm, the head and the pick in one call
(`greedy_ready`, with `native.NativeEnds`). `paged_kv.forward` asks here first and runs
the modules where this gives None.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from tpkit.decode.native import NativeEnds, NativeStack
from tpkit.decode.native import forget as forget_layer
from tpkit.layers.embedding import check_ids

_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: stack}


def _plans(model) -> dict:
    plans = _STACKS.get(model)
    if plans is None:
        plans = _STACKS[model] = {}
    return plans


def stack(model) -> NativeStack | None:
    """The model's layers in one native call (`NativeStack`), or None where it cannot."""
    plans = _plans(model)
    if "layers" not in plans:
        plans["layers"] = NativeStack.of(list(model.layers.values()),
                                         [f"layers.{i}" for i in model.layers])
    return plans["layers"]


def forget(model) -> None:
    """Decide the model's stack, its ends and its layers' plans again at the next decode."""
    _STACKS.pop(model, None)
    for block in model.layers.values():
        forget_layer(block)


def greedy_ready(model, ids: torch.Tensor, kv_caches) -> Callable[[], torch.Tensor] | None:
    """A greedy step of decode rows ids [T, 1] up to its one native call: the function that
    makes it (given the rows' grammar bitmasks or None: `NativeEnds.allow`) and gives each
    row's greedy token and log-probability [T, 2] (`paged_kv._greedy`'s), or None where
    that cannot run (the modules do: `paged_kv`). Every tp rank calls it."""
    layers = stack(model)
    if layers is None or not layers.takes(ids.shape[0], layers.dtype, kv_caches):
        return None
    plans = _plans(model)
    if "ends" not in plans:
        plans["ends"] = NativeEnds.of(model)
    ends = plans["ends"]
    if ends is None:
        return None
    if ends.embeds:
        go, pick = layers.ready(ids, kv_caches, ends), ends.pick
    else:  # the embedding's modules run with the call (no collective before it)
        def go(allowed=None) -> torch.Tensor:
            x = model._embed(ids, None, kv_caches[0].batch.positions)
            return layers.ready(x, kv_caches, ends)(allowed)
        pick = None

    def run(allowed: torch.Tensor | None = None) -> torch.Tensor:  # grammars' bitmasks
        try:
            return go(allowed)
        except IndexError:  # an id outside the table: named, as the module would
            check_ids(ids, model.config.vocab_size)
            raise
    # whether the call still points at these tensors (another call re-points `ends`):
    # their values may change in place between calls (`paged_kv.ready`)
    run.still = lambda: pick is None or ends.pick is pick
    return run
