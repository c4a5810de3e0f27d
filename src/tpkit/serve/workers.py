"""The ranks' start: every rank loads its slices of the model as the `ServeConfig` says
(`load`), and a rank other than its tp group's first runs rank 0's steps
(`Runner.follow`) until rank 0 says STOP. `tpkit generate` and `tpkit serve` hand
`follow` to `tpkit.launch.launch` as `follow=`, which runs it on every such rank:
spawned local processes (their `dead()` names one that died, so that the server can
answer 503 and stop with one line naming the rank) or torchrun's.

    launch(lead, ..., follow=(follow, (source, config)))
"""

from __future__ import annotations

import torch
from torch import nn

from tpkit.mesh import ParallelMesh
from tpkit.serve.adapters import Adapters, read_all
from tpkit.serve.config import ServeConfig
from tpkit.serve.grammar import Grammars
from tpkit.serve.masks import Mirrors
from tpkit.serve.runner import Runner
from tpkit.weights.sources import load_model, source_tokenizer
from tpkit.weights.tokenizer import load_tokenizer


def load(source, mesh: ParallelMesh, config: ServeConfig) -> nn.Module:
    """This rank's slices of `source` (opened by the command) for decoding, in the
    config's dtype (`quantize`: then as int8): what every rank, rank 0 included, serves."""
    return load_model(source, mesh, dtype=getattr(torch, config.dtype), decode=True,
                      quantize=config.quantize)


def follow(mesh: ParallelMesh, source, config: ServeConfig) -> None:
    """A follower rank: load as rank 0 does (`load`), then run rank 0's steps until told
    to stop. Its grammars' mirrors (`serve.masks`) load the source's tokenizer when the
    first grammar comes; --lora's adapters (`serve.adapters`): this rank's shards."""
    model = load(source, mesh, config)
    adapters = Adapters(model, read_all(list(config.lora), model.config)) \
        if config.lora else None
    mirrors = Mirrors(lambda: Grammars(load_tokenizer(source_tokenizer(source)),
                                       model.config.vocab_size))  # rank 0's tokenizer
    Runner(model, mirrors, adapters=adapters).follow()
