"""A whole training step (forward, backward, AdamW) of the same GPT at tp=2 on gloo:
tpkit's Transformer against Megatron-Core's GPTModel built from its local
(non-TransformerEngine) layer spec, and tpkit at tp=1, alternated round by round in
one run, after checking that both tp=2 models compute the same loss and gradients.

    .venv/bin/pip install --no-deps megatron-core      # 0.16.x; keeps torch 2.13.0
    PYTHONPATH=src .venv/bin/python benchmarks/train_vs_megatron.py [--hidden 512]

The GPT: learned positions, LayerNorm, exact GELU (Megatron's default), biases, tied
embeddings, no dropout, vocabulary 8192. Both use torch.optim.AdamW (Megatron's own
optimizer wrappers need CUDA). Two things make Megatron-Core 0.16 run on CPU, both
set here, neither changing its math:
  - its attention takes a scratch buffer from `parallel_state.get_global_memory_buffer()`,
    which allocates on `torch.cuda.current_device()`: replaced by a CPU allocation;
  - its attention dropout forks the CUDA RNG tracker even with dropout 0: the tracker
    is Megatron's own no-op one (`initialize_rng_tracker(inference_rng_tracker=True)`).
"""

from __future__ import annotations

import statistics
import warnings

import torch
import torch.distributed as dist

from common import Contender, environment, parser, print_table, round_robin, write_json
from tpkit.launch import spawn
from tpkit.mesh import ParallelMesh
from tpkit.model import Transformer
from tpkit.spec import get_preset

TP, VOCAB = 2, 8192


def gpt_config(a):
    return get_preset("gpt2-tiny").with_(
        name="gpt-bench", hidden=a.hidden, num_layers=a.layers, num_heads=a.hidden // 64,
        max_seq_len=a.seq, vocab_size=VOCAB, activation="gelu_exact", dropout=0.0)


class _CpuBuffer:
    """Megatron's global memory buffer, allocating on the CPU."""

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype)


def megatron_gpt(c):
    """Megatron-Core's GPTModel (local spec) at tp=TP on the current process group."""
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuBuffer()
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    cfg = TransformerConfig(num_layers=c.num_layers, hidden_size=c.hidden,
                            num_attention_heads=c.num_heads, ffn_hidden_size=c.ffn,
                            tensor_model_parallel_size=TP, use_cpu_initialization=True,
                            params_dtype=torch.float32, hidden_dropout=0.0,
                            attention_dropout=0.0, layernorm_epsilon=c.norm_eps)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=c.vocab_size,
                    max_sequence_length=c.max_seq_len, position_embedding_type="learned_absolute",
                    share_embeddings_and_output_weights=True)


def _qkv_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """tpkit's local [q heads; k heads; v heads] rows -> Megatron's [q_j; k_j; v_j] per head."""
    q, k, v = w.chunk(3)  # [heads*hd, ...] each
    per = [t.chunk(heads) for t in (q, k, v)]
    return torch.cat([x for j in range(heads) for x in (per[0][j], per[1][j], per[2][j])])


def pairs(meg, ours: Transformer) -> list[tuple[str, torch.Tensor, torch.Tensor, bool]]:
    """(name, Megatron's parameter, tpkit's, is qkv): this rank's shards have the same split."""
    src = dict(ours.named_parameters())
    names = {"embedding.word_embeddings.weight": "embed.word.weight",
             "embedding.position_embeddings.weight": "embed.position.weight",
             "decoder.final_layernorm.weight": "final_norm.weight",
             "decoder.final_layernorm.bias": "final_norm.bias"}
    part = {"input_layernorm": "attn_norm", "self_attention.linear_qkv": "attn.qkv",
            "self_attention.linear_proj": "attn.out", "pre_mlp_layernorm": "mlp_norm",
            "mlp.linear_fc1": "mlp.fc1", "mlp.linear_fc2": "mlp.fc2"}
    out = []
    for name, p in meg.named_parameters():
        mine = names.get(name)
        if mine is None:  # decoder.layers.{i}.{part}.{weight|bias}
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            mine = f"layers.{i}.{part[module]}.{kind}"
        out.append((name, p, src[mine], "linear_qkv" in name))
    return out


def copy_weights(meg, ours: Transformer) -> None:
    """Megatron's parameters := tpkit's."""
    heads = ours.config.num_heads // TP
    with torch.no_grad():
        for _, p, value, qkv in pairs(meg, ours):
            p.copy_(_qkv_rows(value, heads) if qkv else value)


def grad_diff(meg, ours: Transformer) -> float:
    """max |Megatron's gradient - tpkit's| over every parameter."""
    heads = ours.config.num_heads // TP
    return max((p.grad - (_qkv_rows(q.grad, heads) if qkv else q.grad)).abs().max().item()
               for _, p, q, qkv in pairs(meg, ours))


def steps(model, ids, labels, megatron: bool):
    """The whole step: zero grads, forward + loss, backward, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    b, s = ids.shape
    pos = torch.arange(s).expand(b, s)
    mask = ~torch.tril(torch.ones(1, 1, s, s, dtype=torch.bool))  # True = masked

    def loss_of():
        if megatron:
            return model(ids, pos, mask, labels=labels).mean()
        return model.loss(model(ids), labels)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        opt.step()
    return loss_of, step


def worker(mesh, a) -> dict | None:
    c = gpt_config(a)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (a.batch, a.seq), generator=gen)
    labels = ids.roll(-1, 1)
    ours = Transformer(c, mesh, seed=1)
    meg = megatron_gpt(c)
    copy_weights(meg, ours)
    single = Transformer(c, ParallelMesh.single(), seed=1)
    (lo, so), (lm, sm), (_, s1) = (steps(ours, ids, labels, False),
                                   steps(meg, ids, labels, True),
                                   steps(single, ids, labels, False))
    a_loss, m_loss = lo(), lm()
    a_loss.backward()
    m_loss.backward()
    diff = max(abs(a_loss.item() - m_loss.item()), grad_diff(meg, ours))
    if diff > a.tol:
        raise AssertionError(f"tpkit and Megatron-Core differ by {diff:.2e} (loss "
                             f"{a_loss.item():.6f} vs {m_loss.item():.6f})")
    cs = [Contender("tpkit tp=2", so), Contender("Megatron-Core tp=2", sm),
          Contender("tpkit tp=1", s1, active=mesh.rank == 0)]
    times = round_robin(cs, a.reps, dist.barrier, warmup=1)
    if mesh.rank:
        return None
    return dict(times=times, diff=diff, loss=a_loss.item())


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tol", type=float, default=1e-5)
    a = p.parse_args()
    if a.quick:
        a.reps = 2
    r = spawn(worker, TP, a, mesh=dict(tp=TP), threads=1, timeout=3600.0)[0]
    med = {n: statistics.median(ts) for n, ts in r["times"].items()}
    ours = med["tpkit tp=2"]
    print_table(f"one training step (fwd, bwd, AdamW): GPT h={a.hidden}, {a.layers} layers, "
                f"b={a.batch}, s={a.seq}, vocab {VOCAB}, fp32, gloo, 1 thread per rank, "
                f"{a.reps} alternated rounds", ["contender", "median ms", "tpkit tp=2 speed vs it"],
                [[n, f"{1e3 * m:.0f}", f"{m / ours:.2f}x"] for n, m in med.items()])
    print(f"checked first: loss {r['loss']:.6f}, max |diff| (loss, every gradient) "
          f"{r['diff']:.1e}")
    write_json("train_vs_megatron", dict(environment=environment(), args=vars(a), median_s=med,
                                         diff=r["diff"]))


if __name__ == "__main__":
    main()
