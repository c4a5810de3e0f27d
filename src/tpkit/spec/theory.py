"""What each layer must send: the communication theory the ledger is held to.

Per transformer layer and micro-batch, with activations [b, s, h] and tp > 1
(Shoeybi et al. 2019; Korthikanti et al. 2022):

    attention:  1 all-reduce of b*s*h forward (after out-proj), 1 backward (before qkv)
    MLP:        1 all-reduce of b*s*h forward (after fc2),      1 backward (before fc1)
                (a mixture of experts too: the experts' partial outputs are summed on
                each rank before that one all-reduce, whatever the number of experts)
    with sequence parallelism, each all-reduce becomes 1 reduce-scatter + 1 all-gather
    of the same b*s*h elements (the same bytes on the wire); where tp does not divide
    s, every rank's part is padded to the largest, ceil(s/tp) tokens, and the padded
    b*tp*ceil(s/tp)*h elements are what is sent (`shapes.sp_padded_seq`: s=7, tp=2 -> 8)
    vocab-parallel embedding: 1 all-reduce of b*s*h forward (or a reduce-scatter with SP)
    vocab-parallel cross-entropy: 3 all-reduces of b*s forward (max, target, sum-exp);
    chunked over tokens (c per chunk): 3 all-reduces of c per chunk, the same b*s numbers
    full recompute: the recomputed forward repeats the layer's forward collectives
    (recorded as forward, while the backward runs)

A list of `Expect` is what `Ledger.compare` checks against, and what the planner prices.
On the wire, a ring over p ranks sends per rank (Thakur et al. 2005):

    all-reduce  2(p-1)/p n      all-gather, reduce-scatter, broadcast  (p-1)/p n
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from tpkit.spec.shapes import even_range, sp_padded_seq

RECOMPUTE = ("none", "selective", "full")
_RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}


def bubble_theory(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle over busy time of a flushed pipeline: (p-1)/m, interleaved (p-1)/(v m)
    (Narayanan et al. 2021, section 2.2)."""
    return (stages - 1) / (virtual_stages * micro_batches)


def warmup_forwards(stage: int, stages: int, chunks: int, micro_batches: int) -> int:
    """Chunk forwards a stage runs before its first backward under 1F1B (chunks = 1:
    p - s - 1) or interleaved 1F1B (2 (p - s - 1) + (v - 1) p), at most all of them."""
    p, v = stages, chunks
    warmup = (p - stage - 1) * 2 + (v - 1) * p if v > 1 else p - stage - 1
    return min(warmup, micro_batches * v)


def peak_in_flight(stage: int, stages: int, chunks: int, micro_batches: int) -> int:
    """Chunk forwards whose activations a stage holds at once, at the schedule's peak:
    the warm-up, plus the first steady forward before its backward (the schedule runs
    `tpkit.parallel.schedules`; the planner prices its memory from this)."""
    return min(warmup_forwards(stage, stages, chunks, micro_batches) + 1,
               micro_batches * chunks)


def interleaved_slot(p: int, v: int, k: int, backward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of a stage's k-th forward (or backward), interleaved:
    Megatron-LM's order (groups of p micro-batches through chunk 0, then chunk 1, ...;
    the backwards with the chunks reversed)."""
    c = (k // p) % v
    return (v - 1 - c if backward else c), (k // (p * v)) * p + k % p


def interleaved_order(stage: int, stages: int, chunks: int, m: int
                      ) -> list[tuple[str, int, int]]:
    """The program of one stage under interleaved 1F1B: ("F" | "B", chunk, micro-batch)."""
    p, v, total = stages, chunks, m * chunks
    warmup = warmup_forwards(stage, p, v, m)
    ops = [("F", *interleaved_slot(p, v, k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [("F", *interleaved_slot(p, v, k + warmup, False)),
                ("B", *interleaved_slot(p, v, k, True))]
    return ops + [("B", *interleaved_slot(p, v, k, True)) for k in range(total - warmup, total)]


@lru_cache(maxsize=4096)  # the planner asks for every stage of 10^4 layouts: few distinct
def peak_layers_in_flight(stage: int, stages: int, chunk_layers: tuple[int, ...],
                          micro_batches: int) -> int:
    """Layer-micro-batches whose activations a stage holds at once, at the peak, when its
    chunks hold `chunk_layers` layers each: the interleaved order walked (Llama 3's
    first chunk of the first stage holds only the embedding, the last chunk of the
    last stage only the output: 0 layers). 1F1B (one chunk): its layers x `peak_in_flight`."""
    v = len(chunk_layers)
    if v == 1:
        return chunk_layers[0] * peak_in_flight(stage, stages, 1, micro_batches)
    held = peak = 0
    for kind, c, _ in interleaved_order(stage, stages, v, micro_batches):
        held += chunk_layers[c] if kind == "F" else -chunk_layers[c]
        peak = max(peak, held)
    return peak


def ring_factor(op: str, p: int) -> float:
    """Share of the tensor's bytes each rank sends for `op` over a ring of p ranks:
    2(p-1)/p for an all-reduce, (p-1)/p for the others; 0 with one rank."""
    return _RING_STEPS.get(op, 1) * (p - 1) / p if p > 1 else 0.0


def ring_steps(op: str, p: int) -> int:
    """Latency steps of `op` on a ring of p ranks: 2(p-1) for an all-reduce, else p-1."""
    return _RING_STEPS.get(op, 1) * (p - 1) if p > 1 else 0


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
    n = b * (sp_padded_seq(s, tp) if sp else s) * h
    if sp:
        return [Expect("all_gather", "forward", n), Expect("reduce_scatter", "forward", n),
                Expect("all_gather", "backward", n), Expect("reduce_scatter", "backward", n)]
    return [Expect("all_reduce", "forward", n), Expect("all_reduce", "backward", n)]


def mlp(b: int, s: int, h: int, tp: int, sp: bool = False) -> list[Expect]:
    """The Megatron MLP: one all-reduce forward, one backward (or their SP halves)."""
    return parallel_block(b, s, h, tp, sp)


def attention(b: int, s: int, h: int, tp: int, sp: bool = False) -> list[Expect]:
    """Heads split over tp: the same traffic as the MLP."""
    return parallel_block(b, s, h, tp, sp)


def layer(b: int, s: int, h: int, tp: int, sp: bool = False,
          recompute: str = "none") -> list[Expect]:
    """One transformer layer: attention + MLP; with full recompute, the forward twice.

    `recompute` is none, selective (only the attention core, which sends nothing) or full."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")
    out = attention(b, s, h, tp, sp) + mlp(b, s, h, tp, sp)
    if recompute == "full":
        out += [e for e in out if e.phase == "forward"]
    return out


def embedding(b: int, s: int, h: int, tp: int, sp: bool = False, trains: bool = True
              ) -> list[Expect]:
    """Vocab-parallel embedding: the masked partial lookups are summed once (with SP a
    reduce-scatter, whose conjugate all-gathers the gradient back for the table, unless
    the table is frozen: LoRA, `trains=False`)."""
    if tp == 1:
        return []
    if sp:
        n = b * sp_padded_seq(s, tp) * h
        back = [Expect("all_gather", "backward", n)] if trains else []
        return [Expect("reduce_scatter", "forward", n), *back]
    return [Expect("all_reduce", "forward", b * s * h)]


def head(b: int, s: int, h: int, tp: int, sp: bool = False) -> list[Expect]:
    """The vocab-parallel output layer: its input's gradient is all-reduced (f), or with
    SP the input is all-gathered forward and its gradient reduce-scattered."""
    if tp == 1:
        return []
    if sp:
        n = b * sp_padded_seq(s, tp) * h
        return [Expect("all_gather", "forward", n), Expect("reduce_scatter", "backward", n)]
    return [Expect("all_reduce", "backward", b * s * h)]


def stage(*, b: int, s: int, h: int, tp: int, num_layers: int, sp: bool = False,
          first: bool = True, last: bool = True, recompute: str = "none", loss_chunk: int = 0,
          embedding_trains: bool = True) -> list[Expect]:
    """Tensor-parallel traffic of one micro-batch through a pipeline stage holding
    `num_layers` layers (the whole model when first and last)."""
    out = embedding(b, s, h, tp, sp, embedding_trains) if first else []
    out += layer(b, s, h, tp, sp, recompute) * num_layers
    if last:
        out += head(b, s, h, tp, sp) + cross_entropy(b, s, tp, loss_chunk)
    return out


def loss_chunks(tokens: int, chunk: int) -> list[int]:
    """Tokens per chunk of the chunked loss (`chunk` each, the rest last; 0: one chunk)."""
    if chunk <= 0 or chunk >= tokens:
        return [tokens]
    return [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])


def cross_entropy(b: int, s: int, tp: int, chunk: int = 0) -> list[Expect]:
    """Vocab-parallel cross-entropy: max, target logit and sum of exp, b*s each; chunked
    over tokens (`chunk` > 0), the same three per chunk of c tokens (backward recomputes
    the chunk's logits from the saved max and sum, sending nothing)."""
    if tp == 1:
        return []
    return [Expect("all_reduce", "forward", c, count=3) for c in loss_chunks(b * s, chunk)]


def stage_step(*, b: int, s: int, h: int, tp: int, pp: int, num_layers: int,
               micro_batches: int, sp: bool = False, first: bool = True, last: bool = True,
               chunks: int = 1, recompute: str = "none", loss_chunk: int = 0,
               tp_rank: int = 0, embedding_trains: bool = True) -> list[Expect]:
    """What one training step of m = `micro_batches` must send on a rank's tp and pp
    groups (keywords as `stage`'s, plus pp, the micro-batches, the stage's chunks and
    the rank's place in its tp group).

    Per micro-batch: `stage` (embedding on the first stage, 2+2 per layer, head and the
    three cross-entropy all-reduces on the last); and between stages one activation
    forward and its gradient backward, [b, s, h] (with SP [b, s_r, h], tp rank r's part
    of s: `shapes.even_range`, unpadded), per chunk of the stage (interleaved), except
    out of the very last chunk and into the very first.
    """
    one = stage(b=b, s=s, h=h, tp=tp, num_layers=num_layers, sp=sp, first=first, last=last,
                recompute=recompute, loss_chunk=loss_chunk, embedding_trains=embedding_trains)
    act = b * (even_range(s, tp, tp_rank)[1] if sp else s) * h
    out, into = chunks - last, chunks - first  # activations leaving / entering the stage
    if pp > 1 and out:
        one += [Expect("send", "forward", act, out), Expect("recv", "backward", act, out)]
    if pp > 1 and into:
        one += [Expect("recv", "forward", act, into), Expect("send", "backward", act, into)]
    return [Expect(e.op, e.phase, e.numel, e.count * micro_batches) for e in one]


def data_parallel(numel: int, dp: int, zero1: bool = False, *, zero2: bool = False,
                  micro_batches: int = 1) -> list[Expect]:
    """One step's gradient sync over dp for `numel` parameters (summed over buckets).

    Plain data parallel all-reduces the gradients. ZeRO-1 (Megatron's distributed
    optimizer) reduce-scatters them instead, since each rank updates only its 1/dp
    slice, then all-gathers the updated weights: the same ring bytes as one all-reduce,
    2(p-1)/p n. With ZeRO-1, `numel` is the flat vector padded to a multiple of dp.
    ZeRO-2 keeps no full gradient past the backward that made it: each of the m
    micro-batches reduce-scatters its gradients (`numel`: one padded bucket), then one
    all-gather of the updated weights.
    """
    if dp == 1:
        return []
    if zero2:
        return [Expect("reduce_scatter", "grads", numel, micro_batches),
                Expect("all_gather", "grads", numel)]
    if zero1:
        return [Expect("reduce_scatter", "grads", numel), Expect("all_gather", "grads", numel)]
    return [Expect("all_reduce", "grads", numel)]


# When FSDP (ZeRO-3) frees the weights it gathered, named after PyTorch FSDP2's options.
FSDP_RESHARD = ("after-forward", "after-step")


def fully_sharded(numel: int, dp: int, micro_batches: int,
                  reshard: str = "after-forward") -> list[Expect]:
    """One step's FSDP (ZeRO-3) traffic over dp for `numel` parameters of one rank, summed
    over the layers it gathers one at a time (and over the virtual stages of a rank).

    after-forward: FSDP2's default, `fully_shard(reshard_after_forward=True)`. Each of the m
    micro-batches all-gathers the weights for its forward, again for its backward, and
    reduce-scatters its gradients: m x (2 AG + RS).
    after-step: `fully_shard(reshard_after_forward=False)` with resharding and gradient
    sync turned off until the step's last backward (`set_reshard_after_backward`,
    `set_requires_gradient_sync`; `torch.distributed.pipelining` drives FSDP2 modules this
    way). The weights are gathered once, at the first forward through
    each layer, and kept; the gradients accumulate unsharded and are reduce-scattered once
    after the last backward: AG + RS, one all-reduce's bytes, as ZeRO-1.
    """
    if reshard not in FSDP_RESHARD:
        raise ValueError(f"fsdp reshard={reshard!r} is not one of {FSDP_RESHARD}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be at least 1")
    if dp == 1:
        return []
    if reshard == "after-step":
        return [Expect("all_gather", "forward", numel), Expect("reduce_scatter", "grads", numel)]
    m = micro_batches
    return [Expect("all_gather", "forward", numel, m), Expect("all_gather", "backward", numel, m),
            Expect("reduce_scatter", "grads", numel, m)]


def context_parallel(b: int, s_local: int, kv_local: int, head_dim: int, cp: int,
                     num_layers: int, micro_batches: int, recompute: str = "none"
                     ) -> list[Expect]:
    """One step's ring-attention traffic on a rank's cp group (`tpkit.layers.ring_attention`).

    Per layer and micro-batch, with n = b * kv_local * s_local * head_dim (one of k, v):
    forward (cp-1) hops of k,v (2n sent, 2n received); backward (cp-1) hops of k,v and
    cp hops of their gradients dk,dv (2n each; the last brings each home). Full
    recompute repeats the forward's hops inside the backward (recorded as forward, like
    the tp traffic).
    """
    if cp == 1:
        return []
    n, count = b * kv_local * s_local * head_dim, num_layers * micro_batches
    fwd = count * (2 if recompute == "full" else 1) * (cp - 1)
    return [Expect(op, phase, 2 * n, c) for op in ("send", "recv")
            for phase, c in (("forward", fwd), ("backward", count * (2 * cp - 1)))]
