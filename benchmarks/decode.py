"""Decoding speed: `tpkit generate` at tp=1 and tp=2 (shared memory, and gloo) against
transformers' own `generate`, on random-weight models saved as Hugging Face folders.

    gpt2-124m     GPT-2 small (12 layers, 12 heads, h=768): tp 1, 2
    smollm2-135m  SmolLM2-135M's shape (30 layers, 9 heads, 3 kv heads, h=576): tp 1, 2
                  (uneven: 5 + 4 heads)

Greedy, --ignore-eos, 48 new tokens after a 16-token prompt, batch 1 and 8. Each tpkit
figure is the tokens/s `tpkit generate` prints (generation only, after loading), from a
fresh process per run; transformers runs in this process on the same folder (its
default threads: every core, like tpkit at tp=1; at tp=n each rank has 1 thread).

    .venv/bin/python benchmarks/decode.py [--quick]

Writes bench-results/decode.json.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import environment, parser, print_table, write_json

NEW, PROMPT = 48, 16
SRC = str(Path(__file__).resolve().parents[1] / "src")
TARGETS = dict(tp2_vs_tp1=1.6, tp1_vs_transformers=1.0)


def save_models(root: Path, quick: bool) -> dict[str, tuple[Path, list[int]]]:
    """Random-weight Hugging Face folders: name -> (folder, tp sizes to run)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = {}
    gpt2 = GPT2LMHeadModel(GPT2Config())
    gpt2.save_pretrained(root / "gpt2-124m")
    out["gpt2-124m"] = (root / "gpt2-124m", [1, 2])
    if not quick:
        smol = LlamaForCausalLM(LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True))
        smol.save_pretrained(root / "smollm2-135m")
        out["smollm2-135m"] = (root / "smollm2-135m", [1, 2])  # 9 heads: 5 + 4
    return out


def prompts(batch: int) -> list[list[int]]:
    """`batch` prompts of PROMPT token ids (the same on every contender)."""
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, 5000, (batch, PROMPT), generator=g).tolist()


def tpkit_tokens_s(folder: Path, tp: int, batch: int, comm: str) -> float:
    """Tokens/s that `tpkit generate` reports (a fresh process)."""
    ids = [f"--prompt-ids={','.join(map(str, p))}" for p in prompts(batch)]
    cmd = [sys.executable, "-m", "tpkit", "generate", "--checkpoint", str(folder), "--tp",
           str(tp), "--max-new-tokens", str(NEW), "--ignore-eos", "--comm", comm, *ids]
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    found = re.search(r"([\d.]+) tokens/s", done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd[:8])}...: {done.stderr.strip()[-500:]}")
    return float(found.group(1))


def transformers_tokens_s(folder: Path, batch: int) -> float:
    """Tokens/s of transformers' greedy generate on the same folder and prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = torch.tensor(prompts(batch))
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        seconds = time.perf_counter() - t0
    return (out.shape[1] - PROMPT) * batch / seconds


def run(quick: bool) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (folder, tps) in save_models(Path(tmp), quick).items():
            for batch in (1, 8):
                row = dict(model=name, batch=batch, tokens_s={})
                row["tokens_s"]["transformers"] = transformers_tokens_s(folder, batch)
                for tp in tps:
                    for comm in (("shm", "gloo") if tp > 1 else ("auto",)):
                        key = f"tpkit tp={tp}" + (f" {comm}" if tp > 1 else "")
                        row["tokens_s"][key] = tpkit_tokens_s(folder, tp, batch, comm)
                print(name, batch, {k: round(v, 1) for k, v in row["tokens_s"].items()},
                      flush=True)
                rows.append(row)
    return rows


def report(rows: list[dict]) -> dict:
    """The table; the targets: tp=2 (shm) >= 1.6x tp=1 and tp=1 >= transformers."""
    table, vs_tp1, vs_hf = [], [], []
    for r in rows:
        t = r["tokens_s"]
        tp_n = next(k for k in t if k.endswith(" shm"))
        vs_tp1.append(t[tp_n] / t["tpkit tp=1"])
        vs_hf.append(t["tpkit tp=1"] / t["transformers"])
        gloo = t[tp_n.replace(" shm", " gloo")]
        table.append([r["model"], str(r["batch"]), f"{t['transformers']:.1f}",
                      f"{t['tpkit tp=1']:.1f}", f"{t[tp_n]:.1f} ({tp_n[6:10]})", f"{gloo:.1f}",
                      f"{vs_tp1[-1]:.2f}x", f"{vs_hf[-1]:.2f}x"])
    print_table(f"decode tokens/s (greedy, {NEW} new tokens, prompt {PROMPT})",
                ["model", "batch", "transformers", "tpkit tp=1", "tpkit tp=n shm",
                 "tpkit tp=n gloo", "tp=n shm / tp=1", "tp=1 / transformers"], table)
    gpt2 = [v for r, v in zip(rows, vs_tp1) if r["model"] == "gpt2-124m"]
    verdict = dict(
        gpt2_tp2_vs_tp1=dict(target=TARGETS["tp2_vs_tp1"], worst=min(gpt2),
                             met=min(gpt2) >= TARGETS["tp2_vs_tp1"]),
        tp1_vs_transformers=dict(target=TARGETS["tp1_vs_transformers"], worst=min(vs_hf),
                                 met=min(vs_hf) >= TARGETS["tp1_vs_transformers"]))
    for name, v in verdict.items():
        print(f"  {name}: target {v['target']}, worst {v['worst']:.2f}, met: {v['met']}")
    return verdict


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    load = Path("/proc/loadavg").read_text().split()[:3]
    rows = run(args.quick)
    verdict = report(rows)
    path = write_json("decode", dict(environment=environment(), load_before=load,
                                     load_after=Path("/proc/loadavg").read_text().split()[:3],
                                     rows=rows, verdict=verdict))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
