"""The one follower loop: a rank other than its tp group's first loads its slices of the
model and runs rank 0's steps (`Runner.follow`) until rank 0 says STOP. `tpkit generate`
and `tpkit serve` hand it to `tpkit.launch.launch` as `follow=`, which runs it on every
such rank: spawned local processes (their `dead()` names one that died, so that the
server can answer 503 and stop with one line naming the rank) or torchrun's.

    launch(lead, ..., follow=(follow, (source, slots, max_len, chunk, dtype)))
"""

from __future__ import annotations

import torch

from tpkit.mesh import ParallelMesh
from tpkit.serve.adapters import Adapters, read_all
from tpkit.serve.grammar import Grammars
from tpkit.serve.masks import Mirrors
from tpkit.serve.runner import Runner
from tpkit.weights.sources import load_model, source_tokenizer
from tpkit.weights.tokenizer import load_tokenizer


def follow(mesh: ParallelMesh, source, slots: int, max_len: int | None, chunk: int | None,
           dtype: torch.dtype | None = None, quantize: str | None = None,
           lora: tuple[str, ...] = ()) -> None:
    """A follower rank: load this rank's slices of `source` (opened by the command) in
    `dtype` (`quantize`: then as int8), then run rank 0's steps until told to stop
    (max_len None or 0: the model's). Its grammars' mirrors (`serve.masks`) load the
    source's tokenizer when the first grammar comes. `lora`: --lora's NAME=DIR values
    (`serve.adapters`), this rank's shards of them."""
    model = load_model(source, mesh, dtype=dtype, decode=True, quantize=quantize)
    adapters = Adapters(model, read_all(list(lora), model.config)) if lora else None
    mirrors = Mirrors(lambda: Grammars(load_tokenizer(source_tokenizer(source)),
                                       model.config.vocab_size))  # rank 0's tokenizer
    Runner(model, slots, max_len or model.config.max_seq_len, chunk, mirrors=mirrors,
           adapters=adapters).follow()
