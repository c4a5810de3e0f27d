"""Shared by the checkpoint, Hugging Face and generation tests (no tests here).

Models are filled with random values drawn for the *logical* (unpadded, tp=1) tensors,
so that a load that confused two ranks' shards, a part of a fused weight or the
vocabulary padding shows up as a difference.
"""

from __future__ import annotations

import torch

from tpkit.checkpoint.build import copy_in
from tpkit.checkpoint.slices import DictSource, local_slice, read_local
from tpkit.comm import all_gather, recv, send
from tpkit.layers.sharding import full_state_dict, meta_of, split_of
from tpkit.mesh import ParallelMesh
from tpkit.model.names import VOCAB_PADDED
from tpkit.model.transformer import Transformer
from tpkit.spec.config import ModelConfig

LLAMA = ModelConfig(name="llama-t", vocab_size=257, hidden=64, num_layers=4, num_heads=8,
                    kv_heads=2, ffn=160, max_seq_len=64, norm="rmsnorm",
                    activation="swiglu", position="rope", tie_embeddings=False, bias=False)
GPT2 = ModelConfig(name="gpt2-t", vocab_size=257, hidden=64, num_layers=4, num_heads=4,
                   max_seq_len=64)
# 9 heads / 3 kv heads, ffn 99: uneven at every tp but 3 (kv 1 on both ranks at tp=2)
SMOL = LLAMA.with_(name="smol-t", hidden=72, num_heads=9, kv_heads=3, ffn=99)


def random_full(config: ModelConfig, seed: int = 1, scale: float = 0.1
                ) -> dict[str, torch.Tensor]:
    """Random logical values for every parameter of the whole model (tp=1, pp=1)."""
    g = torch.Generator().manual_seed(seed)
    ref = Transformer(config, ParallelMesh.single(), device="meta")
    out = {}
    for n, p in ref.named_parameters():
        shape = list(p.shape)
        if n in VOCAB_PADDED:
            shape[0] = config.vocab_size
        out[n] = torch.randn(shape, generator=g) * scale + (1.0 if "norm.weight" in n else 0.0)
    return out


def fill(model: torch.nn.Module, full: dict[str, torch.Tensor], mesh) -> None:
    """Load this rank's slice of `full` (vocabulary padding rows zero)."""
    copy_in(model, read_local(model, DictSource(full), mesh))


def set_grads(model, full_grads: dict[str, torch.Tensor], mesh) -> None:
    """Gradients = this rank's slice of a full gradient dict (same at every layout)."""
    src = DictSource(full_grads)
    for n, p in model.named_parameters():
        name = meta_of(p).tied_to or n
        p.grad = local_slice(src, name, split_of(p), mesh.tp_rank, mesh.tp_size, tuple(p.shape),
                             rows=meta_of(p).logical_size)


def pipeline_logits(model, mesh, ids: torch.Tensor, **kw) -> torch.Tensor | None:
    """Full logits [b, s, V] on the last stage (None elsewhere): stages chained by p2p."""
    b, s = ids.shape
    with torch.no_grad():
        if model.is_first_stage:
            x = ids
        else:
            x = recv(torch.empty(b, s, model.config.hidden), mesh.pp_group, mesh.pp_rank - 1)
        y = model(x, **kw)
        if not model.is_last_stage:
            send(y, mesh.pp_group, mesh.pp_rank + 1)
            return None
        return all_gather(y, mesh.tp_group, dim=-1)[..., :model.config.vocab_size]


def local_state(model, mesh, optimizer=None) -> dict:
    """Coordinates, local parameters (and optimizer moments) and split tags of a rank."""
    names = {id(p): n for n, p in model.named_parameters()}
    opt = {}
    for p, st in (optimizer.state.items() if optimizer is not None else ()):
        for k, v in st.items():
            if torch.is_tensor(v) and v.shape == p.shape and not meta_of(p).tied_to:
                opt[f"{names[id(p)]}::{k}"] = v.detach().clone()
    params = {n: p.detach().clone() for n, p in model.named_parameters()
              if not meta_of(p).tied_to}
    splits = {n: split_of(p) for n, p in model.named_parameters()}
    return dict(tp=mesh.tp_rank, pp=mesh.pp_rank, dp=mesh.dp_rank, params=params, opt=opt,
                splits=splits)


def gather(results: list[dict], vocab: int, key: str = "params") -> dict[str, torch.Tensor]:
    """Full logical tensors from every rank's local ones (dp replica 0)."""
    out = {}
    for s in sorted({r["pp"] for r in results}):
        ranks = sorted((r for r in results if r["pp"] == s and r["dp"] == 0),
                       key=lambda r: r["tp"])
        splits = {n: ranks[0]["splits"][n.split("::")[0]] for n in ranks[0][key]}
        for n, t in full_state_dict([r[key] for r in ranks], splits).items():
            padded = n.split("::")[0] in VOCAB_PADDED
            out[n] = t[:vocab] if padded else t
    return out
