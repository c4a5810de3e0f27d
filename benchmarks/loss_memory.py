"""Peak memory (and time) of the head + loss, forward and backward: the plain path
(head matmul -> logits [tokens, V/tp] -> vocab-parallel cross-entropy) against the
chunked one (`tpkit.layers.chunked_loss`), one process (tp=1), fp32, CPU.

    PYTHONPATH=src .venv/bin/python benchmarks/loss_memory.py [--batch 2] [--seq 1024]

Memory is counted by `LiveBytes`, a torch dispatch mode that sees every tensor any
op creates inside the block (forward and backward; tracemalloc does not see torch's
allocator) and holds a weak reference to its storage: after each op, the bytes of
the storages still alive; the peak of that over the block. It counts what the head +
loss allocate beyond their inputs (the final hidden states and the head's weight),
the weight's gradient [V, h] included. Both paths are checked equal (loss, dh, dW).
"""

from __future__ import annotations

import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common import environment, parser, print_table, write_json
from tpkit.layers.chunked_loss import chunked_head_cross_entropy
from tpkit.layers.cross_entropy import vocab_parallel_cross_entropy
from tpkit.layers.linear import column_parallel_linear
from tpkit.mesh import ParallelMesh
from tpkit.spec import get_preset


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the block and still alive
    (storages of `known` tensors, the inputs, are not counted)."""

    def __init__(self, *known: torch.Tensor) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key not in self.known and (key not in self.refs or self.refs[key][0].expired()):
                    self.refs[key] = (StorageWeakRef(st), st.nbytes())
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out


def head_loss(h, w, labels, group, vocab: int, chunk: int) -> torch.Tensor:
    """Mean loss of the head + cross-entropy, plain (chunk=0) or chunked."""
    if chunk:
        per_token = chunked_head_cross_entropy(h, w, labels, group, vocab, chunk=chunk)
    else:
        logits = column_parallel_linear(h, w, None, group)  # [b, s, V]
        per_token = vocab_parallel_cross_entropy(logits, labels, group, vocab)
    return per_token.mean()


def measure(h, w, labels, group, vocab: int, chunk: int) -> dict:
    """Peak bytes allocated by forward + backward, seconds, and what was computed."""
    h.grad = w.grad = None
    t0 = time.perf_counter()
    with LiveBytes(h, w) as tracker:
        loss = head_loss(h, w, labels, group, vocab, chunk)
        loss.backward()
    seconds = time.perf_counter() - t0
    peak = tracker.peak
    return dict(chunk=chunk, peak_bytes=peak, seconds=seconds, loss=loss.item(),
                dh=h.grad.clone(), dw=w.grad.clone())


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--chunks", default="1024,512,256,128", help="tokens per chunk, comma-separated")
    a = p.parse_args()
    cfg = get_preset(a.preset)
    group = ParallelMesh.single().tp_group
    gen = torch.Generator().manual_seed(0)
    vpad = cfg.padded_vocab(1)
    h = torch.randn(a.batch, a.seq, cfg.hidden, generator=gen).requires_grad_()  # [b, s, h]
    w = (torch.randn(vpad, cfg.hidden, generator=gen) * 0.02).requires_grad_()  # [V_pad, h]
    labels = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=gen)
    chunks = [int(c) for c in a.chunks.split(",")][: 1 if a.quick else None]
    plain = measure(h, w, labels, group, cfg.vocab_size, 0)
    rows, out = [], []
    for c in chunks:
        r = measure(h, w, labels, group, cfg.vocab_size, c)
        diff = max(abs(r["loss"] - plain["loss"]), (r["dh"] - plain["dh"]).abs().max().item(),
                   (r["dw"] - plain["dw"]).abs().max().item())
        if diff > 1e-5:
            raise AssertionError(f"chunk={c}: differs from the plain path by {diff:.2e}")
        out.append(dict(chunk=c, peak_mib=r["peak_bytes"] / 2**20, seconds=r["seconds"],
                        max_diff=diff, ratio=plain["peak_bytes"] / r["peak_bytes"]))
    tokens = a.batch * a.seq
    rows.append(["plain (all logits)", f"{plain['peak_bytes'] / 2**20:.0f}", "1.00x",
                 f"{plain['seconds']:.1f}", "-"])
    rows += [[f"chunked, {o['chunk']} tokens", f"{o['peak_mib']:.0f}", f"{o['ratio']:.2f}x",
              f"{o['seconds']:.1f}", f"{o['max_diff']:.1e}"] for o in out]
    print_table(f"{a.preset} head + loss, {tokens} tokens ({a.batch} x {a.seq}), V_pad={vpad}, "
                f"fp32, forward + backward", ["path", "peak MiB", "lower by", "s", "max diff"],
                rows)
    dw_mib = w.numel() * 4 / 2**20
    print(f"of which the head's gradient dW [{vpad}, {cfg.hidden}] alone: {dw_mib:.0f} MiB")
    write_json("loss_memory", dict(environment=environment(), preset=a.preset, batch=a.batch,
                                   seq=a.seq, plain_peak_mib=plain["peak_bytes"] / 2**20,
                                   plain_seconds=plain["seconds"], dw_mib=dw_mib, chunked=out))


if __name__ == "__main__":
    main()
