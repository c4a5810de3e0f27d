"""tpkit's `Embedder` (what `tpkit serve` runs for POST /v1/embeddings) against
transformers' BertModel with sentence-transformers' pooling, in one process, on
all-MiniLM-L6-v2's shapes (6 layers, 384 wide, 12 heads, random weights saved as a
Hugging Face folder): `--inputs` inputs of 8 to `--longest` random token ids, in
batches of `--batch` (sentence-transformers' default 32, sorted by length as it does),
mean-pooled over the mask and L2-normalised; tpkit as `tpkit serve` runs it (forwards
of up to 8 x 512 padded tokens). Both at tp=1, float32, torch's threads.

    PYTHONPATH=src python benchmarks/embed_vs_transformers.py [--inputs 256] [--rounds 5]

The vectors are checked equal (1e-5) before timing. Medians of `--rounds` alternating
rounds (`common.round_robin`); prints inputs/s, the ratio and the load average.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Contender, median_ms, parser, print_table, round_robin  # noqa: E402
from tpkit.mesh import ParallelMesh  # noqa: E402
from tpkit.serve.embedder import Embedder  # noqa: E402
from tpkit.weights.pooling import Pooling  # noqa: E402
from tpkit.weights.sources import load_model  # noqa: E402

MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512)


def reference(model, inputs: list[list[int]], batch: int) -> torch.Tensor:
    """sentence-transformers' encode: sorted by length, padded batches, mean, normalise."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out = [None] * len(inputs)
    with torch.no_grad():
        for at in range(0, len(order), batch):
            rows = [inputs[i] for i in order[at:at + batch]]
            s = max(map(len, rows))
            ids = torch.tensor([r + [0] * (s - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (s - len(r)) for r in rows])
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).float()
            v = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=1)
            for i, row in zip(order[at:at + batch], v):
                out[i] = row
    return torch.stack(out)


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--longest", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    rng = random.Random(0)
    inputs = [[rng.randrange(1000, 30000) for _ in range(rng.randint(8, args.longest))]
              for _ in range(args.inputs)]
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**MINILM)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = load_model(tmp, ParallelMesh.single())
    embedder = Embedder(model, Pooling("mean", True))  # tpkit serve's 8 x 512 padded tokens
    ours, theirs = embedder.embed(inputs), reference(hf, inputs, args.batch)
    assert (ours - theirs).abs().max() <= 1e-5, (ours - theirs).abs().max()
    times = round_robin([Contender("tpkit Embedder", lambda: embedder.embed(inputs)),
                         Contender("transformers + ST pooling",
                                   lambda: reference(hf, inputs, args.batch))], args.rounds)
    tokens = sum(map(len, inputs))
    rows = [[name, f"{median_ms(t):.0f}", f"{args.inputs / (median_ms(t) / 1e3):.0f}",
             f"{tokens / (median_ms(t) / 1e3):.0f}"] for name, t in times.items()]
    ratio = median_ms(times["transformers + ST pooling"]) / median_ms(times["tpkit Embedder"])
    print_table(f"{args.inputs} inputs of 8-{args.longest} tokens, MiniLM-L6 shapes, "
                f"{torch.get_num_threads()} threads, medians of {args.rounds}",
                ["", "ms", "inputs/s", "tokens/s"], rows)
    print(f"tpkit / transformers speed: {ratio:.2f}x; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
