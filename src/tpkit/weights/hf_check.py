"""A Hugging Face model in tpkit, checked against `transformers` itself at any tp.

    ids = sample_ids(config, batch=2, seq=16)
    ref = reference(path, ids)                     # transformers, float32
    got = gather([tp_case(mesh, path, ids) for each rank of a tp group])
    compare(ref, got) -> {"out": .., "loss": .., "grads": ..}   max |difference|

    ref = reference(path, ids, torch.bfloat16)     # both sides in bfloat16
    compare(ref, got, relative=True)   # each max |difference| / the reference's max |value|

The reference is computed by `transformers` (its own model class, float32 or the
dtype asked, tpkit's model then loaded in the same dtype): causal
models give logits and the next-token cross-entropy, encoders (BERT) their last
hidden states and mean(h^2). Its gradients are mapped to tpkit names by the family's
recipe, so every tpkit gradient is compared with the very tensor it stands for.
`tp_case` also holds the ledger to the theory: per layer exactly the collectives of
`theory.layer` (2 all-reduces forward, 2 backward), and 3 for the loss.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tpkit.comm import all_gather
from tpkit.layers.sharding import full_state_dict, meta_of, splits_of
from tpkit.spec import theory
from tpkit.spec.config import ModelConfig
from tpkit.weights.hf import HFSource, checkpoint_names, hf_source
from tpkit.weights.sources import load_model


def sample_ids(config: ModelConfig, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Random token ids [batch, seq] in the model's vocabulary."""
    return torch.randint(0, config.vocab_size, (batch, seq),
                         generator=torch.Generator().manual_seed(seed))


def _loss(out: torch.Tensor, ids: torch.Tensor, causal: bool) -> torch.Tensor:
    if not causal:
        return out.pow(2).mean()
    labels = torch.roll(ids, -1, 1)  # [b, s]
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1))


def reference(path: str | Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32
              ) -> dict:
    """transformers' outputs, loss and gradients (in tpkit names) for `ids`, in `dtype`."""
    # lazy: optional (tpkit[hf])
    import transformers

    source = hf_source(path)
    config = source.config
    cls = transformers.AutoModelForCausalLM if config.causal else transformers.AutoModel
    model = cls.from_pretrained(str(path), dtype=dtype).eval()
    o = model(ids)
    out = o.logits if config.causal else o.last_hidden_state
    loss = _loss(out, ids, config.causal)
    loss.backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
             for n, p in model.named_parameters()}
    src = HFSource(checkpoint_names(model, grads), source.family, source.recipes, "grads")
    names = [n for n in source.recipes if src.logical_shape(n) is not None]
    full = {n: src.read(n, 0, 0, src.logical_shape(n)[0]) for n in names}
    return dict(out=out.detach(), loss=loss.item(), grads=full)


def tp_case(mesh, path: str, ids: torch.Tensor, sp: bool = False, ep: bool = False,
            dtype: torch.dtype | None = None) -> dict:
    """On each rank: load `path` at the mesh's tp in `dtype` (with sequence parallelism if
    `sp`, experts spread whole over tp if `ep`), forward + backward, ledger vs theory."""
    model = load_model(path, mesh, dtype=dtype, sequence_parallel=sp,
                       expert_parallel=ep).train()
    c, tp = model.config, mesh.tp_size
    mesh.ledger.clear()
    out = model(ids) if c.causal else model.hidden_states(ids)
    loss = model.loss(out, torch.roll(ids, -1, 1)) if c.causal else out.pow(2).mean()
    loss.backward()
    model.finalize_grads()
    b, s = ids.shape
    problems = [f"layers.{i}: {p}" for i in range(c.num_layers) for p in
                mesh.ledger.compare(theory.layer(b, s, c.hidden, tp, sp), scope=f"layers.{i}")]
    if c.causal:
        problems += [f"loss: {p}" for p in
                     mesh.ledger.compare(theory.cross_entropy(b, s, tp), scope="loss")]
        with mesh.ledger.paused():  # gathered for the comparison only
            out = all_gather(out.detach(), mesh.tp_group, dim=-1)[..., :c.vocab_size]
    return dict(out=out.detach(), loss=loss.item(), splits=splits_of(model), problems=problems,
                grads={n: p.grad if p.grad is not None else torch.zeros_like(p)
                       for n, p in model.named_parameters()},
                rows={n: meta_of(p).logical_size for n, p in model.named_parameters()
                      if meta_of(p).logical_size},
                param_bytes=model.param_bytes(),
                table=mesh.ledger.table(f"ledger at tp={tp} (rank {mesh.rank})"))


def gather(results: list[dict]) -> dict:
    """Full gradients (vocabulary padding cut) and rank 0's outputs and loss."""
    r0 = results[0]
    grads = full_state_dict([r["grads"] for r in results], r0["splits"])
    grads = {n: g[:r0["rows"][n]] if n in r0["rows"] else g for n, g in grads.items()}
    return dict(r0, grads=grads)


def compare(ref: dict, got: dict, relative: bool = False) -> dict:
    """max |difference| of outputs, loss and gradients (over every parameter); `relative`:
    each divided by the reference's largest |value| of the same kind (the loss by its
    own |value|), the measure of a low-precision dtype's rounding."""
    d = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    missing = set(got["grads"]) ^ set(ref["grads"])
    if missing:
        raise ValueError(f"parameters not on both sides: {sorted(missing)}")
    diffs = dict(out=d(ref["out"], got["out"]), loss=abs(ref["loss"] - got["loss"]),
                 grads=max(d(ref["grads"][n], got["grads"][n]) for n in ref["grads"]))
    if relative:
        top = lambda t: t.double().abs().max().item() or 1.0  # noqa: E731
        diffs["out"] /= top(ref["out"])
        diffs["loss"] /= abs(ref["loss"]) or 1.0
        diffs["grads"] /= max(top(g) for g in ref["grads"].values())
    return diffs
