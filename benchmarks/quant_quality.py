"""What `--quantize int8` (and `--dtype bfloat16`) costs in quality: the logits of a
fixed English text through a Hugging Face model folder, each variant against float32
at the same tp: the largest and the mean |logit difference|, how often the greedy token
(argmax) changes, and the perplexity of the text.

    .venv/bin/python benchmarks/quant_quality.py --folder HF_DIR [--tp 1,2]

A random-weight model's perplexity says nothing (about the vocabulary size); use real
weights, e.g. SmolLM2-135M-Instruct as an fp32 folder. Writes
bench-results/quant_quality.json.
"""

from __future__ import annotations

import math

import torch

from common import environment, parser, print_table, write_json

TEXT = (
    "Tensor parallelism splits each weight matrix of a transformer layer across several "
    "processes. The first matrix of the feed-forward block is divided by columns, so "
    "every process computes its own slice of the hidden activations without talking to "
    "the others; the second matrix is divided by rows, and the partial products are "
    "added together with a single all-reduce. Attention is divided by heads in the same "
    "way: each process keeps the queries, keys and values of its heads, and the output "
    "projection sums their contributions. When a model generates text, one token at a "
    "time, the cost of each step is dominated by reading the weights from memory, which "
    "is why smaller weights, in sixteen or eight bits, make decoding faster. The price "
    "is a small error in every product, which this measurement states in numbers rather "
    "than in words. A good library reports what it measured, how it measured it, and "
    "which targets it missed, so that a reader can run the same command and check.")
VARIANTS = {"float32": (torch.float32, None), "bfloat16": (torch.bfloat16, None),
            "int8": (torch.float32, "int8")}


def _logits(mesh, folder: str, ids: list[int]) -> dict[str, torch.Tensor]:
    """Full logits [s, V] float32 of every variant on this rank (all ranks return them)."""
    from tpkit.comm import all_gather
    from tpkit.weights.sources import load_model, open_source

    out = {}
    for name, (dtype, how) in VARIANTS.items():
        model = load_model(open_source(folder), mesh, dtype=dtype, quantize=how).eval()
        with torch.no_grad():
            local = model.logits(model.body(torch.tensor([ids])))[0]
        out[name] = all_gather(local, model.group, dim=-1)[:, :model.config.vocab_size].float()
        del model
    return out


def measure(logits: dict[str, torch.Tensor], ids: list[int]) -> dict[str, dict]:
    """Each variant against float32: logit distances, argmax changes, perplexity."""
    ref = logits["float32"]
    target = torch.tensor(ids[1:])
    rows = {}
    for name, x in logits.items():
        nll = torch.nn.functional.cross_entropy(x[:-1], target)
        d = (x - ref).abs()
        rows[name] = dict(max_abs=d.max().item(), mean_abs=d.mean().item(),
                          max_rel=(d.max() / ref.abs().max()).item(),
                          argmax_changed=(x.argmax(-1) != ref.argmax(-1)).float().mean().item(),
                          perplexity=math.exp(nll.item()))
    return rows


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--folder", required=True, help="a Hugging Face model folder")
    p.add_argument("--tp", default="1")
    args = p.parse_args()
    from tpkit.launch import spawn
    from tpkit.mesh import ParallelMesh
    from tpkit.weights.tokenizer import load_tokenizer

    ids = load_tokenizer(args.folder).encode(TEXT)
    load = open("/proc/loadavg").read().split()[:3]
    table, result = [], {}
    for tp in map(int, args.tp.split(",")):
        logits = _logits(ParallelMesh.single(), args.folder, ids) if tp == 1 else \
            spawn(_logits, tp, args.folder, ids, mesh=dict(tp=tp), timeout=1800)[0]
        rows = result[f"tp={tp}"] = measure(logits, ids)
        for name, r in rows.items():
            table.append([str(tp), name, f"{r['max_abs']:.4f}", f"{r['mean_abs']:.4f}",
                          f"{r['max_rel']:.2%}", f"{r['argmax_changed']:.1%}",
                          f"{r['perplexity']:.3f}"])
    print_table(f"quality against float32 ({len(ids)} tokens of a fixed text)",
                ["tp", "variant", "max |dlogit|", "mean |dlogit|", "max / max|logit|",
                 "argmax changed", "perplexity"], table)
    path = write_json("quant_quality", dict(environment=environment(), load=load,
                                            tokens=len(ids), rows=result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
