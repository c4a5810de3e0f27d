"""How a model's pieces are divided over ranks: small integer rules, once. Pure Python.

    stage layers     pp stages take consecutive layers, as even as possible, the first
                     stages one extra each:  10 layers over 4 stages -> 3, 3, 2, 2
    padded vocab     V rounded up to a multiple of 8 tp, so each rank holds a multiple of
                     8 rows (GEMMs on odd widths such as GPT-2's 50257 are slow on GPUs)
    kv heads         split like the query heads when tp divides them; with fewer kv heads
                     than ranks (GQA, MQA) each rank keeps the one its query heads read
    micro-batches    by default, up to 2 per pipeline stage that divide the batch of a
                     replica: 8 sequences over pp=2 -> 4 micro-batches, bubble 1/4

The runtime (layers, model, checkpoints) and the planner both import these.
"""

from __future__ import annotations


def stage_layer_range(num_layers: int, pp: int, stage: int) -> range:
    """Global layer indices of pipeline stage `stage` (earlier stages take the remainder)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def layers_per_stage(num_layers: int, pp: int) -> list[int]:
    """How many layers each of the pp stages holds."""
    return [len(stage_layer_range(num_layers, pp, s)) for s in range(pp)]


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows after padding: a multiple of 8 rows on each of tp ranks. The padded
    rows are zeros that never win a softmax; checkpoints store only `vocab_size` rows."""
    return -(-vocab_size // (8 * tp)) * 8 * tp


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """kv heads one rank holds: kv/tp when tp divides them, else 1 (shared by tp/kv ranks)."""
    return kv_heads // tp if kv_heads >= tp else 1


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
    """Why query and kv heads cannot be split over tp ranks (empty: they can): query heads
    split evenly; kv heads divide the query heads and are split or shared over tp."""
    out = [f"num_heads={num_heads} is not divisible by tp={tp}"] if num_heads % tp else []
    kv = kv_heads
    if kv < 1 or num_heads % kv:
        return out + [f"num_heads={num_heads} is not a multiple of kv_heads={kv}"]
    if kv % tp and tp % kv:
        return out + [f"kv_heads={kv} is neither a multiple nor a divisor of tp={tp}"]
    return out


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
