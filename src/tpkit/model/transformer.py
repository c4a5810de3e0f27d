"""`Transformer`: the one model definition. tp=1 is the single-device reference.

    ids [b, s] -> Embeddings (vocab-parallel; + positions, token types)
               -> Block x L (this pipeline stage's share, global indices)
               -> final norm -> head (column-parallel, tied to the embedding or not)
               -> logits [b, s, V_pad/tp], never gathered -> vocab_parallel_cross_entropy

With pipeline parallelism each stage builds only its layers (embedding on the
first, final norm and head on the last); parameter names keep global layer
indices so checkpoints do not depend on the layout.

Interleaved 1F1B (Narayanan et al. 2021, section 2.2): with `virtual_stages=v` stage
s holds v chunks, chunk c being virtual stage c*pp + s of pp*v; all their layers sit
in the one `layers` dict, run one chunk at a time by `forward_chunk(c, x)`:

    pp=2, v=2, 8 layers:   stage 0: layers 0 1 | 4 5     stage 1: layers 2 3 | 6 7
                                   chunk 0  chunk 1              chunk 0  chunk 1
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from tpkit.comm import compile_ready, ops
from tpkit.decode.generate import generate, pad_left
from tpkit.layers.chunked_loss import chunked_head_cross_entropy
from tpkit.layers.cross_entropy import vocab_parallel_cross_entropy
from tpkit.layers.embedding import VocabParallelEmbedding, padded_master
from tpkit.layers.grads import finalize_tp_grads
from tpkit.layers.linear import column_parallel_linear
from tpkit.layers.lora import freeze_base
from tpkit.layers.norm import Norm
from tpkit.layers.random import TPRandom, checkpointed, dropout
from tpkit.layers.ring_attention import cp_positions
from tpkit.layers.sharding import TPSplit, master_normal, seed_for, set_meta, shard
from tpkit.model import names
from tpkit.model.block import Block
from tpkit.model.names import EMBED_WEIGHT
from tpkit.model.text import generate_text, is_text
from tpkit.spec.config import ModelConfig
from tpkit.spec.errors import UserError
from tpkit.spec.shapes import (
    LOSS_CHUNK_SAYS,
    chunks_problem,
    even_range,
    loss_chunk_ok,
    stage_layer_range,
)


def replicated_linear(c: ModelConfig, seed: int, name: str, kw: dict) -> nn.Linear:
    """A replicated [h, h] linear drawn from the seed, zero bias (BERT's pooler)."""
    lin = nn.Linear(c.hidden, c.hidden, **kw)
    if not lin.weight.is_meta:
        with torch.no_grad():
            lin.weight.copy_(master_normal((c.hidden, c.hidden), c.init_std, seed_for(seed, name)))
            lin.bias.zero_()
    return lin


class Embeddings(nn.Module):
    """Word (vocab-parallel) + learned positions + token types; replicated extras."""

    def __init__(self, c: ModelConfig, group, sp: bool, seed: int, cp=None, device=None,
                 dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.word = VocabParallelEmbedding(c.vocab_size, c.hidden, group, sequence_parallel=sp,
                                           init_std=c.init_std, seed=seed_for(seed, names.WORD),
                                           **kw)
        self.group, self.sp, self.p, self.scale = group, sp, c.dropout, c.embed_scale
        self.position = self._table(c.max_seq_len, c, seed, names.POSITION, sp, kw) \
            if c.position == "learned" else None
        self.token_type = self._table(c.type_vocab_size, c, seed, names.TOKEN_TYPE, sp, kw) \
            if c.type_vocab_size else None
        self.norm = Norm(c.hidden, c.norm, c.norm_eps, sequence_parallel=sp, **kw) \
            if c.embed_norm else None
        self.cp = cp  # context parallel group: this rank's tokens keep global positions

    @staticmethod
    def _table(n, c, seed, name, sp, kw):
        e = nn.Embedding(n, c.hidden, **kw)
        if not e.weight.is_meta:
            with torch.no_grad():
                e.weight.copy_(master_normal((n, c.hidden), c.init_std, seed_for(seed, name)))
        set_meta(e.weight, sequence_parallel=sp)  # with SP each rank adds its slice only
        return e

    def forward(self, ids, token_types=None, position_offset: int = 0, rng=None):
        """ids [b, s] -> [b, s, h] (or [b, s/tp, h] with SP)."""
        x = self.word(ids)  # reduced over tp (all-reduce, or reduce-scatter with SP)
        if self.scale != 1.0:
            x = x * torch.tensor(self.scale, dtype=x.dtype)  # Gemma: sqrt(hidden), in x's dtype
        s_local = x.shape[1]  # this rank's part of the sequence with SP (uneven: 7 -> 4 + 3)
        first = even_range(ids.shape[1], self.group.size, self.group.rank)[0] if self.sp else 0
        if self.position is not None:  # position_offset: an int, or one per row [b]
            start = torch.as_tensor(position_offset, device=ids.device).reshape(-1, 1)
            local = torch.arange(first, first + s_local, device=ids.device)  # [s]
            if self.cp is not None:  # this cp rank's global positions [s], SP slice of them
                local = cp_positions(ids.shape[1], self.cp, device=ids.device)[local]
            pos = start + local  # [b|1, s]
            x = x + self.position(pos.clamp(min=0))  # left padding: negative, masked anyway
        if self.token_type is not None:
            tt = token_types if token_types is not None else torch.zeros_like(ids)
            x = x + self.token_type(tt[:, first:first + s_local] if self.sp else tt)
        if self.norm is not None:
            x = self.norm(x)
        return dropout(x, self.p, self.training, rng, sharded=self.sp)


class Transformer(nn.Module):
    """GPT-2, Llama and BERT style transformers, tensor- and pipeline-parallel.

    Built complete from its arguments: on a mesh with cp > 1 every layer's attention is a
    ring over `mesh.cp_group` and the embedding uses the tokens' global positions
    (`tpkit.parallel.context`); `compile_backend` (`tpkit train --compile`) compiles each
    block in place and the chunked loss's element-wise work (`tpkit.train.compile`)."""

    def __init__(self, config: ModelConfig, mesh, *, seed: int = 0,
                 sequence_parallel: bool = False, recompute: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 virtual_stages: int = 1, expert_parallel: bool = False,
                 loss_chunk: int = 0, compile_backend: str | None = None) -> None:
        super().__init__()
        tp, pp, v = mesh.tp_size, mesh.pp_size, virtual_stages
        config.check(tp=tp, pp=pp)  # every rank, before any collective
        if not loss_chunk_ok(loss_chunk):
            raise UserError(f"loss_chunk={loss_chunk} {LOSS_CHUNK_SAYS}")
        if chunks_problem(config.num_layers, pp, v):
            raise UserError(f"{config.name}: {chunks_problem(config.num_layers, pp, v)}")
        self.config, self.mesh, self.group = config, mesh, mesh.tp_group
        self.tokenizer = None  # text in, text out (`model.text`): set by `tpkit.load`
        self.sequence_parallel, self.recompute, self.seed = sequence_parallel, recompute, seed
        self.virtual_stages = v
        # > 0: the last stage returns its final hidden states and `loss` runs the head and
        # the cross-entropy `loss_chunk` tokens at a time (tpkit.layers.chunked_loss)
        self.loss_chunk = loss_chunk
        self.loss_compile = compile_backend  # the chunked loss's element-wise work too
        self.chunk_layers = [stage_layer_range(config.num_layers, pp * v, c * pp + mesh.pp_rank)
                             for c in range(v)]  # chunk c = virtual stage c*pp + pp_rank
        self.layer_range = self.chunk_layers[0] if v == 1 else \
            [i for r in self.chunk_layers for i in r]
        self.is_first_stage, self.is_last_stage = mesh.pp_rank == 0, mesh.pp_rank == pp - 1
        device = device if device is not None else mesh.device
        kw = dict(device=device, dtype=dtype)
        self.rng = TPRandom(seed, mesh.tp_rank, torch.device(device) if str(device) != "meta"
                            else None)
        cp = mesh.cp_group if mesh.cp_size > 1 else None  # ring attention, global positions
        if self.is_first_stage:
            self.embed = Embeddings(config, self.group, sequence_parallel, seed, cp, **kw)
        self.layers = nn.ModuleDict({
            str(i): Block(config, self.group, layer_index=i, sequence_parallel=sequence_parallel,
                          seed=seed, expert_parallel=expert_parallel, cp=cp, **kw)
            for i in self.layer_range})  # chunk by chunk
        if compile_backend:
            compile_ready()  # the collectives: graph breaks between the compiled regions
        for block in self.layers.values() if compile_backend else ():
            block.compile(backend=compile_backend)  # in place: names, state dicts unchanged
        if self.is_last_stage:  # post-norm stacks end normalized: no final norm
            self.final_norm = Norm(config.hidden, config.norm, config.norm_eps,
                                   sequence_parallel=sequence_parallel,
                                   offset=config.norm_offset, **kw) \
                if config.pre_norm else None
            self._make_head(kw)
            self.pooler = replicated_linear(config, seed, names.POOLER, kw) if config.pooler \
                else None
        if config.lora_rank:
            freeze_base(self)  # LoRA: only the adapters train

    def _make_head(self, kw) -> None:
        c, tp = self.config, self.group.size
        self.head_decoding = None  # the head in a decode-only form (`decode.forms.for_decode`)
        if c.tie_embeddings and self.is_first_stage:
            self.head = None  # the embedding table itself
            return
        padded = c.padded_vocab(tp)
        split = TPSplit.even(0, padded)
        w = nn.Parameter(torch.empty(padded // tp, c.hidden, **kw))
        if not w.is_meta:
            name = names.WORD if c.tie_embeddings else names.HEAD
            full = padded_master(c.vocab_size, padded, c.hidden, c.init_std, seed_for(self.seed,
                                                                                     name))
            with torch.no_grad():
                w.copy_(shard(full, split, self.group.rank, tp))
        self.head = nn.Module()
        # rows past vocab_size are padding; tied: a copy of the first stage's table whose
        # gradients are summed over pp
        self.head.weight = set_meta(w, split=split, logical_size=c.vocab_size,
                                    tied_to=EMBED_WEIGHT if c.tie_embeddings else None)

    @property
    def head_weight(self) -> torch.Tensor:
        """The output projection [V_pad/tp, h] (the embedding table when tied on one stage)."""
        return self.embed.word.weight if self.head is None else self.head.weight

    def activation_shape(self, b: int, s: int) -> tuple[int, int, int]:
        """Shape of the hidden states passed between pipeline stages on this rank (with SP
        its part of the sequence: s=7 at tp=2 -> 4 on rank 0, 3 on rank 1)."""
        g = self.group
        local = even_range(s, g.size, g.rank)[1] if self.sequence_parallel else s
        return (b, local, self.config.hidden)

    def _sequence(self, x: torch.Tensor, seq: int | None):
        """The block in which SP's gathers know the whole sequence: `seq`, or the ids'
        length; a stage fed hidden states without `seq` keeps what is set (if nothing,
        the gathers assume equal parts, as when tp divides the sequence). Without SP
        nothing (a decode step pays nothing for it)."""
        if not self.sequence_parallel or self.group.size == 1:
            return nullcontext()
        if seq is None and x.dim() == 2 and not x.is_floating_point():
            seq = x.shape[1]  # token ids [b, s]
        return ops.sequence(self.group, seq if seq is not None else self.group.sp_seq)

    def chunk_is_first(self, c: int) -> bool:
        """Does chunk `c` take token ids (virtual stage 0, with the embedding)?"""
        return self.is_first_stage and c == 0

    def chunk_is_last(self, c: int) -> bool:
        """Does chunk `c` end the model (last virtual stage, with norm and head)?"""
        return self.is_last_stage and c == self.virtual_stages - 1

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_types: torch.Tensor | None = None,
                position_offset: int | torch.Tensor = 0, seq: int | None = None
                ) -> torch.Tensor:
        """First stage: ids [b, s]; others: hidden. Last stage returns logits [b, s, V_pad/tp].
        `seq`: the whole sequence's length, for a later stage fed its SP part of it."""
        if self.virtual_stages > 1 and self.mesh.pp_size > 1:
            raise RuntimeError("an interleaved stage holds several chunks: use forward_chunk")
        with self._sequence(x, seq):
            h = self.body(x, attention_mask, token_types, position_offset)
            return self.logits(h) if self.is_last_stage and not self.loss_chunk else h

    def forward_chunk(self, c: int, x: torch.Tensor,
                      attention_mask: torch.Tensor | None = None,
                      token_types: torch.Tensor | None = None,
                      seq: int | None = None) -> torch.Tensor:
        """Chunk `c` only: ids [b, s] or hidden in; hidden, or logits after the last chunk.
        `seq`: the whole sequence's length (with SP a later chunk gets a part of it)."""
        with self._sequence(x, seq):
            if self.chunk_is_first(c):
                x = self._embed(x, token_types, 0)
            x = self._run_layers(self.chunk_layers[c], x, attention_mask)
            if not self.chunk_is_last(c):
                return x
            x = self.final_norm(x) if self.final_norm is not None else x
            return x if self.loss_chunk else self.logits(x)

    def body(self, x, attention_mask=None, token_types=None, position_offset=0):
        """Embedding (first stage) and this stage's layers; final norm on the last stage."""
        with self._sequence(x, None):
            if self.is_first_stage:
                x = self._embed(x, token_types, position_offset)
            x = self._run_layers(list(self.layers), x, attention_mask)
            return self.final_norm(x) if self.is_last_stage and self.final_norm is not None \
                else x

    def _embed(self, ids, token_types, position_offset: int) -> torch.Tensor:
        with self.mesh.ledger.scope("embed"):  # its all-reduce (or reduce-scatter) is named
            return self.embed(ids, token_types, position_offset, self.rng)

    def _run_layers(self, indices, x, attention_mask) -> torch.Tensor:
        """Layers `indices` (global) in order."""
        seq = self.group.sp_seq  # SP: the recomputed forward (in backward) gathers it too
        if self.config.lora_rank and torch.is_grad_enabled() and not x.requires_grad:
            x = x.detach().requires_grad_()  # LoRA's frozen stem: each layer sends as ever
        for i in indices:
            layer = self.layers[str(i)]
            with self.mesh.ledger.scope(f"layers.{i}"):
                if self.recompute and self.training:
                    x = checkpointed(lambda t, lay=layer: self._again(lay, t, attention_mask, seq),
                                     self.rng, x)
                else:
                    x = layer(x, attention_mask, self.rng)
        return x

    def _again(self, layer: Block, x: torch.Tensor, attention_mask, seq: int | None):
        """`layer(x)` under the sequence of its first forward (a recompute runs it again)."""
        with ops.sequence(self.group, seq):
            return layer(x, attention_mask, self.rng)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden [b, s, h] ([b, s/tp, h] with SP) -> vocab-parallel logits. With SP
        on a sequence tp does not divide, inside `forward` (or `tpkit.comm.sequence`)."""
        with self.mesh.ledger.scope("head"):  # a column-parallel layer over the vocabulary
            if self.head_decoding is not None:  # a decode: nothing to send
                return self.head_decoding(h)  # [b, s, V_pad/tp]
            return column_parallel_linear(h, self.head_weight, None, self.group,
                                          self.sequence_parallel)  # [b, s, V_pad/tp]

    def hidden_states(self, ids, attention_mask=None, token_types=None) -> torch.Tensor:
        """Final hidden states [b, s, h] (gathered over the sequence with SP)."""
        with self._sequence(ids, None):
            h = self.body(ids, attention_mask, token_types)
            return ops.gather_from_sp(h, self.group) if self.sequence_parallel else h

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT's pooler output tanh(W h[:, 0] + b) [b, h] from final hidden states."""
        return torch.tanh(self.pooler(hidden[:, 0]))

    def loss(self, last: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
             label_smoothing: float = 0.0, divide_by: float | None = None) -> torch.Tensor:
        """Mean cross-entropy over non-ignored tokens; identical on every tp rank.

        `last`: what the last stage returned, the vocab-parallel logits, or with
        `loss_chunk` the final hidden states (the head then runs inside the chunked loss).
        `divide_by`: the sum over the non-ignored tokens divided by this instead of their
        count (masked labels: the batch's count, so the step's loss is its masked mean)."""
        if self.loss_chunk:
            per_token = chunked_head_cross_entropy(
                last, self.head_weight, labels, self.group, self.config.vocab_size,
                chunk=self.loss_chunk, sequence_parallel=self.sequence_parallel,
                ignore_index=ignore_index, label_smoothing=label_smoothing,
                compile_backend=self.loss_compile)  # [b, s]
        else:
            with self.mesh.ledger.scope("loss"):
                per_token = vocab_parallel_cross_entropy(
                    last, labels, self.group, self.config.vocab_size,
                    ignore_index=ignore_index, label_smoothing=label_smoothing)  # [b, s]
        if divide_by is not None:
            return per_token.sum() / divide_by
        return per_token.sum() / (labels != ignore_index).sum().clamp(min=1)

    def generate(self, ids, max_new_tokens: int = 32, **kw):
        """Tokens [b, s + n] after `ids` [b, s] (or a list of prompts, left-padded):
        `tpkit.decode.generate.generate` (its keywords: temperature, top_k, eos_id...).
        Text (a string, or a list of them) gives text, through `self.tokenizer`
        (`tpkit.model.text`; `stream=True`: an iterator of its pieces).
        Call on every tp rank; every rank returns the same tokens."""
        if is_text(ids):
            return generate_text(self, ids, max_new_tokens, **kw)
        if not torch.is_tensor(ids):
            ids, kw["attention_mask"] = pad_left(ids, kw.get("pad_id", 0), self.mesh.device)
        return generate(self, ids, max_new_tokens, **kw)

    def finalize_grads(self) -> None:
        """The tensor-parallel gradient sums (SP norms, shared kv heads); once per step."""
        finalize_tp_grads(self, self.group)

    def param_bytes(self) -> int:
        """Bytes of parameters on this rank."""
        return sum(p.numel() * p.element_size() for p in self.parameters())
