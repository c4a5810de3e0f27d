"""How a model's pieces are divided over ranks: small integer rules, once. Pure Python.

    even range       n units (layers, heads, ffn columns) over p ranks, as even as
                     possible, the first ranks one extra each: 10 over 4 -> 3, 3, 2, 2;
                     9 heads at tp=2 -> 5 + 4; 14 at tp=4 -> 4, 4, 3, 3
    stage layers     pp stages take consecutive layers by the even range
    sequence (SP)    under sequence parallelism the residual stream [b, s, h] is cut along
                     s by the even range: s=7 at tp=2 -> 4 + 3; its all-gathers and
                     reduce-scatters pad every part to the largest (tp * ceil(s/tp)
                     rows cross the wire) and trim
    padded vocab     V rounded up to a multiple of 8 tp, so each rank holds a multiple of
                     8 rows (GEMMs on odd widths such as GPT-2's 50257 are slow on GPUs)
    kv heads         each rank keeps the kv heads its query heads read (GQA): a range of
                     kv groups, a kv head held by every rank that reads it (9 heads, 3 kv
                     at tp=2: q 0-4 | 5-8, kv 0-1 | 1-2; kv 1 on both, its gradient summed)
    micro-batches    by default, up to 2 per pipeline stage that divide the batch of a
                     replica: 8 sequences over pp=2 -> 4 micro-batches, bubble 1/4

The runtime (layers, model, checkpoints) and the planner both import these.
"""

from __future__ import annotations

from functools import lru_cache


def even_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """(offset, size) of share `i` of n units cut into `parts` shares as evenly as
    possible, the first n % parts shares one unit more: the one rule that says which
    part of a split dimension a rank owns (`tpkit.spec.split.TPSplit` reads it)."""
    base, extra = divmod(n, parts)
    return i * base + min(i, extra), base + (1 if i < extra else 0)


def even_sizes(n: int, parts: int) -> list[int]:
    """The size of every share of `even_range`: 7 over 2 -> [4, 3]."""
    return [even_range(n, parts, i)[1] for i in range(parts)]


def sp_padded_seq(seq: int, tp: int) -> int:
    """Rows of the sequence that a sequence-parallel all-gather or reduce-scatter moves:
    every rank's part padded to the largest, ceil(seq/tp), so tp * ceil(seq/tp) (seq
    itself when tp divides it). The ledger's theory prices these padded rows."""
    return tp * -(-seq // tp)


def kv_range(num_heads: int, kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first, count) of the kv heads that `rank`'s query heads read under grouped-query
    attention (query head j reads kv head j // (num_heads / kv_heads))."""
    q0, nq = even_range(num_heads, tp, rank)
    group = num_heads // kv_heads
    first = q0 // group
    return first, ((q0 + nq - 1) // group - first + 1) if nq else 0


def stage_layer_range(num_layers: int, pp: int, stage: int) -> range:
    """Global layer indices of pipeline stage `stage` (earlier stages take the remainder)."""
    start, size = even_range(num_layers, pp, stage)
    return range(start, start + size)


def layers_per_stage(num_layers: int, pp: int) -> list[int]:
    """How many layers each of the pp stages holds."""
    return list(_layers_per_stage(num_layers, pp))


@lru_cache(maxsize=1024)  # the planner asks for every stage of 10^4 layouts
def _layers_per_stage(num_layers: int, pp: int) -> tuple[int, ...]:
    return tuple(len(stage_layer_range(num_layers, pp, s)) for s in range(pp))


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows after padding: a multiple of 8 rows on each of tp ranks. The padded
    rows are zeros that never win a softmax; checkpoints store only `vocab_size` rows."""
    return -(-vocab_size // (8 * tp)) * 8 * tp


def heads_per_rank(num_heads: int, tp: int) -> int:
    """Query heads the largest of tp ranks holds (rank 0: ceil(num_heads / tp))."""
    return -(-num_heads // tp)


def kv_heads_per_rank(num_heads: int, kv_heads: int, tp: int) -> int:
    """kv heads the rank holding most of them holds (kv/tp when tp divides kv and heads
    alike; 1 when groups of tp/kv ranks share one; one more where query ranges straddle
    a kv group)."""
    return max(kv_range(num_heads, kv_heads, tp, r)[1] for r in range(tp))


def cp_chunks(seq: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The [start, end) token ranges that context-parallel rank `rank` of `cp` holds: the
    sequence cut into 2 cp chunks, rank r taking chunk r and its mirror 2 cp - 1 - r, so
    each rank does the same share of causal attention work (the early chunks see few
    keys, their mirrors many):  seq=8, cp=2 -> rank 0: [0, 2) + [6, 8), rank 1: [2, 6)."""
    if seq % (2 * cp):
        raise ValueError(f"seq={seq} is not divisible by 2*cp = {2 * cp} (context parallelism "
                         f"cuts it into 2 cp chunks)")
    c = seq // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return [(rank * c, (rank + 1) * c), (mirror * c, (mirror + 1) * c)]


def heads_problems(num_heads: int, kv_heads: int, tp: int) -> list[str]:
    """Why query and kv heads cannot be split over tp ranks (empty: they can): every rank
    needs one query head at least (any tp up to num_heads: uneven splits are exact), and
    the kv heads must divide the query heads (each kv head reads a whole group)."""
    out = [f"tp={tp} is more than num_heads={num_heads} (each rank needs one query head "
           f"at least)"] if tp > num_heads else []
    if kv_heads < 1 or num_heads % kv_heads:
        out.append(f"num_heads={num_heads} is not a multiple of kv_heads={kv_heads}")
    return out


LOSS_CHUNK_SAYS = "must be 0 (off) or a positive number of tokens"


def loss_chunk_ok(tokens: int) -> bool:
    """Is `tokens` a cross-entropy chunk (`loss_chunk`): 0 (off) or a number of tokens?
    The rule of TrainConfig's knob and of the Transformer (`LOSS_CHUNK_SAYS` if not)."""
    return tokens >= 0


def chunks_problem(num_layers: int, pp: int, virtual_stages: int) -> str | None:
    """Why pp stages of `virtual_stages` chunks each cannot hold the layers (every chunk
    needs one at least), or None."""
    chunks = pp * virtual_stages
    if virtual_stages < 1 or chunks > num_layers:
        return (f"pp*virtual_stages = {pp}*{virtual_stages} = {chunks} chunks is more than "
                f"num_layers={num_layers}" if virtual_stages >= 1 else
                f"virtual_stages={virtual_stages} must be a positive integer")
    return None


def interleave_problem(micro_batches: int, pp: int) -> str | None:
    """Why interleaved 1F1B cannot run `micro_batches` over pp stages (it sends them in
    rounds of pp), or None."""
    if micro_batches % pp:
        return f"micro_batches={micro_batches} is not a multiple of pp={pp} (interleaved 1F1B)"
    return None


# The default's aim: a 1F1B bubble (p-1)/m below 1/2 without many tiny micro-batches. On
# gpt2-tiny, tp=2 x pp=2 on a 2-core CPU: m=1 5.0k tokens/s, measured bubble 0.46; m=4
# 3.8k, 0.19; m=8 1.7k, 0.19 (each micro-batch has its own fixed costs).
MICRO_BATCHES_PER_STAGE = 2


def default_micro_batches(pp: int, per_replica: int, interleaved: bool = False) -> int:
    """The micro-batches a step of `per_replica` sequences (global batch / dp) is cut into
    when none are asked: 1 at pp=1; over pp stages the most, up to 2 per stage, that
    divide `per_replica` (so global_batch stays divisible by dp * micro-batches), and
    for the interleaved schedule a multiple of pp; 1 when none does."""
    if pp <= 1 or per_replica < 1:
        return 1
    fits = [m for m in range(1, min(per_replica, MICRO_BATCHES_PER_STAGE * pp) + 1)
            if per_replica % m == 0 and not (interleaved and interleave_problem(m, pp))]
    return max(fits, default=1)
