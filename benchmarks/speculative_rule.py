"""What the never-lose rule proposes on the speculation benchmark's texts, counted rather
than timed (issue 49): greedy texts do not depend on speculation, so at a fixed row cost
c the rule's proposals are fixed too, and a load that makes timings noise changes none
of these counts.

    .venv/bin/python benchmarks/speculative_rule.py --hf SMOLLM2 [--dtype bfloat16] \\
        [--costs 0.1,0.3,0.5] [--texts FILE]

The texts: `serve_speculative.py`'s prompts, chat-templated, greedy, grounded 96 tokens
and ungrounded 64 (one engine, one prompt at a time: a bfloat16 text may depend on
what else the step computed; `--texts FILE` keeps them, and reads them from there next
time). Then each sequence alone (one client) through
`serve.speculate.Speculator(row_cost=c)`: proposals, accepted tokens, and the estimated
decode speed-up, decode tokens / sum over steps of (1 + c * proposed rows) (a step of
r more rows costing 1 + c r steps); "bound": a proposer that knew how many of its
lookup's tokens would be accepted and proposed only those (at most K = 4).
"1 client": the benchmark's first two prompts; "all": every prompt of the set.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_peers import PROMPTS  # noqa: E402
from serve_speculative import grounded  # noqa: E402
from tpkit.serve.speculate import Speculator, _State, lookup  # noqa: E402


def texts(hf: str, dtype: str) -> dict[str, list]:
    """{set: [(prompt ids, greedy output ids)]}: the benchmark's prompts, generated."""
    import torch
    from transformers import AutoTokenizer

    import tpkit
    from tpkit.serve import Engine, SamplingParams
    tok = AutoTokenizer.from_pretrained(hf)
    model = tpkit.load(hf, tp=1, dtype=getattr(torch, dtype), decode=True)
    out = {}
    for name, prompts, new in (("grounded", grounded(), 96), ("ungrounded", PROMPTS, 64)):
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                       add_generation_prompt=True, return_dict=False)
               for p in prompts]
        engine = Engine(model, max_batch=8, max_len=2048)  # one at a time, as one client
        out[name] = [(p, engine.generate([p], SamplingParams(max_tokens=new))[0].tokens)
                     for p in ids]
    return out


def rule(prompt: list[int], ref: list[int], cost: float) -> tuple[float, int, int]:
    """The rule on one sequence decoding `ref`: (steps weighted by rows, proposed,
    accepted)."""
    spec = Speculator(row_cost=cost)
    req = SimpleNamespace(id=1, prompt=prompt, tokens=ref[:1], computed=len(prompt),
                          params=SimpleNamespace(max_tokens=len(ref), grammar=None))

    def give(_row) -> str | None:
        req.tokens.append(ref[len(req.tokens)])
        return "length" if len(req.tokens) == len(ref) else None

    steps = 0.0
    while len(req.tokens) < len(ref):
        draft = spec.propose([req], 7, lambda r, n: n).get(req.id, [])
        steps += 1 + cost * len(draft)
        if draft:
            spec.accept(req, draft, [None] * (len(draft) + 1), give)
        else:
            give(None)
        req.computed = len(prompt) + len(req.tokens) - 1
    return steps, spec.proposed, spec.accepted


def bound(prompt: list[int], ref: list[int], cost: float, k: int = 4) -> float:
    """Steps weighted by rows of a proposer that proposes only the tokens accepted."""
    st, i, steps = _State(k), 1, 0.0
    while i < len(ref):
        draft = lookup(st, prompt + ref[:i], min(k, len(ref) - i - 1))
        n = 0
        while n < len(draft) and draft[n] == ref[i + n]:
            n += 1
        steps, i = steps + 1 + cost * n, i + 1 + n
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="a Hugging Face folder (SmolLM2-135M)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--costs", default="0.1,0.3,0.5")
    p.add_argument("--texts", help="a JSON file of the texts: read if it exists, else written")
    args = p.parse_args()
    if args.texts and Path(args.texts).is_file():
        sets = json.loads(Path(args.texts).read_text())
    else:
        sets = texts(args.hf, args.dtype)
        if args.texts:
            Path(args.texts).write_text(json.dumps(sets))
    for name, seqs in sets.items():
        for cost in map(float, args.costs.split(",")):
            for label, some in (("1 client", seqs[:2]), ("all", seqs)):
                tokens = sum(len(ref) - 1 for _, ref in some)
                runs = [rule(prompt, ref, cost) for prompt, ref in some]
                best = sum(bound(prompt, ref, cost) for prompt, ref in some)
                print(f"{name:10} c={cost:.2f} {label:8}: x{tokens / sum(r[0] for r in runs):.3f}"
                      f" ({sum(r[2] for r in runs)} of {sum(r[1] for r in runs)} accepted),"
                      f" bound x{tokens / best:.3f}", flush=True)


if __name__ == "__main__":
    main()
