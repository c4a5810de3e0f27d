"""Level 2's live demonstrations: what tpkit implements, shown by its ledger and planner.

Each function returns its figures, `text` (from `live_text.json`) and `charts`; the
page's size selector sets tp (and p, where the question is about p ranks or stages).
"""

from __future__ import annotations

import torch

from tpkit.comm.group import CommGroup
from tpkit.comm.ledger import Record
from tpkit.layers import ParallelMLP
from tpkit.plan.hardware import PROFILES
from tpkit.plan.memory import Precision, model_state_bytes, params_per_rank
from tpkit.plan.simulate import Cluster, Layout, evaluate
from tpkit.quiz import live_charts as C
from tpkit.quiz import live_ranks as R
from tpkit.quiz.live_common import Spawner, max_diff, x_input
from tpkit.quiz.live_level1 import heads_arithmetic, heads_chart
from tpkit.quiz.live_text import Say
from tpkit.spec.config import PRESETS
from tpkit.spec.theory import bubble_theory


def _wire(recs: list[tuple]) -> float:
    return sum(r[3] for r in recs)


def demo_sequence_parallel(live: Spawner, tp: int = 2, b: int = 2, s: int = 8,
                           hidden: int = 16, ffn: int = 64, lang: str = "en") -> dict:
    """SP: the all-reduce becomes a reduce-scatter + an all-gather, the same wire bytes."""
    x = x_input(b, s, hidden)
    ranks = live.spawn(R.sp_traffic, x, hidden, ffn, tp=tp)
    with torch.no_grad():
        y_ref = ParallelMLP(hidden, ffn, CommGroup.single())(x)  # [b, s, h]
    y_sp = torch.cat([r["sp"]["y"] for r in ranks], dim=1)  # the sequence slices, in order
    plain, sp = ranks[0]["plain"]["records"], ranks[0]["sp"]["records"]
    out = dict(tp=tp, plain=plain, sp=sp, plain_bytes=_wire(plain), sp_bytes=_wire(sp),
               sp_vs_ref=max_diff(y_sp, y_ref), slice_shape=list(ranks[0]["sp"]["y"].shape))
    say = Say(lang, "sp")
    lines = [say("head", b=b, s=s, hidden=hidden, tp=tp),
             say("plain", records=say.records(plain), bytes=out["plain_bytes"]),
             say("sp", records=say.records(sp), bytes=out["sp_bytes"]),
             say("diff", shape=out["slice_shape"], diff=out["sp_vs_ref"])]
    chart = C.bars(say("chart", tp=tp), "B", [
        C.bar(say("plain_bar"), out["plain_bytes"], f"{out['plain_bytes']:.0f} B", 0),
        C.bar(say("sp_bar"), out["sp_bytes"], f"{out['sp_bytes']:.0f} B", 2)])
    return dict(out, text="\n".join(lines), charts=[chart])


def demo_vocab_parallel(live: Spawner, tp: int = 2, b: int = 2, s: int = 4, vocab: int = 512,
                        hidden: int = 16, lang: str = "en") -> dict:
    """Vocab-parallel cross-entropy: 3 all-reduces of b*s values instead of b*s*V logits."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(b, s, vocab, generator=g)  # [b, s, V]
    target = torch.randint(0, vocab, (b, s), generator=g)  # [b, s]
    ranks = live.spawn(R.vocab_parallel_traffic, logits, target, target, hidden, tp=tp)
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(),
                                            reduction="none").view(b, s)
    ce, emb = ranks[0]["ce"], ranks[0]["emb_records"]
    gather = Record("all_gather", "tp", tp, b * s * vocab, 4 * b * s * vocab, 0.0, "", "forward")
    out = dict(tp=tp, ce=ce, emb=emb, ce_bytes=_wire(ce), gather_bytes=gather.wire_bytes,
               loss_vs_ref=max(max_diff(r["loss"], ref) for r in ranks))
    say = Say(lang, "vocab")
    lines = [say("head", b=b, s=s, vocab=vocab, tp=tp, per_rank=vocab // tp),
             say("ce", records=say.records(ce), bytes=out["ce_bytes"]),
             say("gather", bytes=out["gather_bytes"], ratio=out["gather_bytes"] / out["ce_bytes"]),
             say("emb", records=say.records(emb)), say("diff", diff=out["loss_vs_ref"])]
    chart = C.bars(say("chart", tp=tp, vocab=vocab), "B", [
        C.bar(say("ce_bar"), out["ce_bytes"], f"{out['ce_bytes']:.0f} B", 2),
        C.bar(say("gather_bar"), out["gather_bytes"], f"{out['gather_bytes']:.0f} B", "comm")])
    return dict(out, text="\n".join(lines), charts=[chart])


def demo_gqa(live: Spawner, tp: int = 2, hidden: int = 64, num_heads: int = 8,
             lang: str = "en") -> dict:
    """GQA with fewer kv heads than ranks (tp/2): each kv head replicated on 2 ranks."""
    kv = tp // 2
    ranks = live.spawn(R.attention_heads, x_input(2, 4, hidden), hidden, num_heads, kv, tp=tp)
    per_rank = [dict(rank=i, q_heads=r["q"], kv_heads=r["kv"], qkv_weight=r["qkv"])
                for i, r in enumerate(ranks)]
    out = dict(tp=tp, num_kv_heads=kv, per_rank=per_rank,
               matches=[[p["q_heads"], p["kv_heads"]] for p in per_rank]
               == [heads_arithmetic(num_heads, kv, tp, i) for i in range(tp)])
    say = Say(lang, "gqa")
    lines = [say("head", heads=num_heads, kv=kv, tp=tp)]
    lines += [say("rank", rank=p["rank"], q=p["q_heads"], kv=p["kv_heads"], qkv=p["qkv_weight"])
              for p in per_rank]
    lines.append(say("match", ok=say.yes_no(out["matches"])))
    return dict(out, text="\n".join(lines), charts=[heads_chart(Say(lang, "heads"), per_rank, tp)])


def demo_bubble(live: Spawner, tp: int = 2, micro: tuple[int, ...] = (4, 8, 16, 32),
                lang: str = "en") -> dict:
    """The planner's pipeline bubble (p-1)/(v m) for p = tp stages, with and without
    interleaving (v = 2)."""
    p = tp
    table = {m: [bubble_theory(p, m, v) for v in (1, 2)] for m in micro}
    out = dict(pp=p, bubble={str(m): f for m, f in table.items()})
    say = Say(lang, "bubble")
    lines = [say("head", p=p)] + [say("row", m=m, one=f[0] * 100, two=f[1] * 100)
                                  for m, f in table.items()]
    items = []
    for m, f in table.items():
        items += [C.bar(say("bar", m=m, v=v), f[i] * 100, f"{f[i] * 100:.1f} %", 0 if v == 1 else 2)
                  for i, v in enumerate((1, 2))]
    return dict(out, text="\n".join(lines), charts=[C.bars(say("chart", p=p), "%", items)])


def demo_zero(live: Spawner, tp: int = 2, model: str = "llama2-7b", lang: str = "en") -> dict:
    """The planner's bytes of model state per GPU, without and with ZeRO-1 over dp = 2 tp."""
    dp = 2 * tp
    params = params_per_rank(PRESETS[model], 1, 1, 0)
    plain = model_state_bytes(params, dp, False, Precision())
    zero = model_state_bytes(params, dp, True, Precision())
    out = dict(dp=dp, params=params, plain=plain, zero=zero)
    say = Say(lang, "zero")
    gb = 2 ** 30
    lines = [say("head", model=model, params=params / 1e9, dp=dp)]
    lines += [say("row", part=say(k), plain=plain[k] / gb, zero=zero[k] / gb) for k in plain]
    lines.append(say("total", plain=sum(plain.values()) / gb, zero=sum(zero.values()) / gb))
    items = []
    for k in plain:
        items += [C.bar(f"{say(k)} ({say(tag)})", d[k] / gb, f"{d[k] / gb:.1f} GiB", c)
                  for tag, d, c in (("without", plain, "muted"), ("with", zero, 2))]
    return dict(out, text="\n".join(lines), charts=[C.bars(say("chart", dp=dp), "GiB", items)])


def demo_tp_nodes(live: Spawner, tp: int = 2, model: str = "gpt3-175b",
                  lang: str = "en") -> dict:
    """The planner's step on 2 nodes of 8 H100: tp=8 inside a node (pp=2) vs tp=16 across."""
    cluster, c = Cluster(PROFILES["h100"], nodes=2), PRESETS[model]
    est = {t: evaluate(c, 2048, 64, Layout(tp=t, pp=16 // t, dp=1, micro_batch=1), cluster)
           for t in (8, 16)}
    out = {f"tp{t}": dict(step_s=e.step_time_s, tp_comm_s=e.terms["tp_comm"],
                          compute_s=e.terms["compute"]) for t, e in est.items()}
    say = Say(lang, "tp_nodes")
    lines = [say("head", model=model)] + [
        say("row", tp=t, pp=16 // t, step=e.step_time_s, comm=e.terms["tp_comm"],
            compute=e.terms["compute"]) for t, e in est.items()]
    items = []
    for t, e in est.items():
        items += [C.bar(say("bar", tp=t, what=say(k)), e.terms[k], f"{e.terms[k]:.2f} s",
                        0 if k == "compute" else "comm") for k in ("compute", "tp_comm")]
        items.append(C.bar(say("bar", tp=t, what=say("step")), e.step_time_s,
                           f"{e.step_time_s:.2f} s", "muted"))
    return dict(out, text="\n".join(lines), charts=[C.bars(say("chart", model=model), "s", items)])


def demo_ring(live: Spawner, tp: int = 2, numel: int = 1024, lang: str = "en") -> dict:
    """Ring all-reduce: each rank sends 2(p-1)/p n bytes; the ledger's count at p = tp,
    and the same rule at p = 2, 4, 8."""
    rec = live.spawn(R.ring_all_reduce, numel, tp=tp)[0]["records"][0]
    n = 4 * numel
    rule = {p: Record("all_reduce", "tp", p, numel, n, 0.0, "", "forward").wire_bytes
            for p in (2, 4, 8)}
    out = dict(tp=tp, nbytes=n, measured_wire=rec[3], rule=rule)
    say = Say(lang, "ring")
    lines = [say("head", numel=numel, bytes=n, tp=tp, wire=rec[3], factor=rec[3] / n)]
    lines += [say("rule", p=p, wire=w, factor=w / n) for p, w in rule.items()]
    items = [C.bar(say("bar", p=p) + (" ✓" if p == tp else ""), w, f"{w:.0f} B ({w / n:.2f} n)",
                   0 if p == tp else "muted", ref=2 * n) for p, w in rule.items()]
    return dict(out, text="\n".join(lines),
                charts=[C.bars(say("chart", bytes=n), "B", items, ref_label="2n")])


def demo_bias(live: Spawner, tp: int = 2, b: int = 1, s: int = 2, hidden: int = 8,
              ffn: int = 32, lang: str = "en") -> dict:
    """Row-parallel bias: added once after the all-reduce; once per rank would be tp times."""
    y = x_input(b, s, ffn, seed=2)  # [b, s, ffn]
    ranks = live.spawn(R.row_bias, y, ffn, hidden, 0.5, tp=tp)
    z, bias = ranks[0]["z"], ranks[0]["bias"]
    wrong = sum(r["partial"] + r["bias"] for r in ranks)  # bias added on every rank
    out = dict(tp=tp, z_vs_wrong=max_diff(z, wrong), bias=float(bias[0]),
               expected_gap=(tp - 1) * float(bias[0]))
    say = Say(lang, "bias")
    lines = [say("head", tp=tp, bias=out["bias"]),
             say("gap", diff=out["z_vs_wrong"], tp=tp, expected=out["expected_gap"])]
    terms = [C.term(f"Y{i + 1}B{i + 1}", r["partial"][0, 0, :4], i) for i, r in enumerate(ranks)]
    chart = C.sums(say("chart", tp=tp), terms + [C.term("b", bias[:4], "muted")],
                   C.term("Z", z[0, 0, :4], "ok"), C.term(say("wrong", tp=tp), wrong[0, 0, :4],
                                                         "comm"))
    return dict(out, text="\n".join(lines), charts=[chart])


DEMOS = {1: demo_sequence_parallel, 2: demo_vocab_parallel, 3: demo_gqa, 4: demo_bubble,
         5: demo_zero, 6: demo_tp_nodes, 7: demo_ring, 8: demo_bias}
