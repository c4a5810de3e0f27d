"""The decode step's native kernels (`kernels.decode_ops`) and the layer path built on them.

Checked against float64 references: the products of a few rows (float32, bfloat16 and
int8 weights; bias, residual, SwiGLU's gate fused) within K float32 roundings of the sum
of |terms| (bfloat16 outputs: plus one bfloat16 rounding); a row's bits the same alone or
among 8 rows, at 1 or 2 threads (batch invariance by construction); the norms (RMSNorm,
LayerNorm, Gemma's offset) within a few float32 roundings, bfloat16 within one bfloat16
rounding of the reference; the GELU fused into fc1's product F.gelu's bits; the rotary
embedding and cache write bit for bit `apply_rope` + the cache's index writes (full and
partial rotary, none). A decode-only model (`for_decode`) takes the native layer path on
every layer of every decode step and its token-by-token logits are as close to the
float64 model's as its float32 full forward's, for a Llama (GQA, SwiGLU, RMSNorm) and a
GPT-2 (LayerNorm, GELU, biases); its three paths (one native call, the layer calls, the
modules) give the same bits for both.
At tp > 1 (SmolLM2's 9 heads: uneven at tp=2, even at 3) the stack sums inside its
call on the shared-memory channel: the per-layer path's logits bit for bit and its
ledger records, and a rank killed while the other is inside it named in one line.
Without the library (TPKIT_DECODE_OPS_DISABLE=1) the weights are packed as before.
"""

from __future__ import annotations

import copy
import ctypes
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from checkpoint_helpers import SMOL, fill, random_full
from test_paged_attention_kernel import _decode_logits
from tpkit.decode import native, stacks
from tpkit.decode.forms import QMAX, for_decode
from tpkit.kernels import decode_ops as D
from tpkit.layers.rotary import apply_rope, rope_at
from tpkit.mesh import ParallelMesh
from tpkit.model.transformer import Transformer
from tpkit.spec import get_preset

pytestmark = pytest.mark.skipif(D.load() is None, reason="no C++ compiler: the kernels are off")
U32 = 2.0 ** -23  # a float32 rounding unit (relative)
UBF = 2.0 ** -8  # a bfloat16 one


def _operands(n, k, wdtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if wdtype == torch.int8:
        scale = w.abs().amax(1) / QMAX
        q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
        return D.Operand(q, scale), q.double() * scale.double()[:, None]
    w = w.to(wdtype)
    return D.Operand(w), w.double()


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [40, 99, 576])
def test_products_within_k_roundings_of_float64(wdtype, xdtype, k):
    op, w = _operands(33, k, wdtype, seed=k)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 1, k, generator=g).to(xdtype)
        b = torch.randn(33, generator=g).to(xdtype)
        res = torch.randn(rows, 1, 33, generator=g).to(xdtype)
        xd, bd = x.double(), b.double()
        for got, want, extra in (
                (op(x), xd @ w.t(), 0),
                (op(x, b, res), res.double() + (xd @ w.t() + bd), (bd.abs() + res.double().abs()))):
            assert got.dtype == xdtype and got.shape == (rows, 1, 33)
            bound = k * U32 * (xd.abs() @ w.abs().t()) + 2 * U32 * extra
            if xdtype == torch.bfloat16:  # the output rounded once
                bound = bound + UBF * want.abs()
            assert ((got.double() - want).abs() <= bound + 1e-30).all(), (rows, wdtype)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.int8])
def test_gated_product_is_silu_of_gate_times_up(wdtype):
    op, w = _operands(2 * 24, 64, wdtype, seed=3)
    x = torch.randn(5, 1, 64, generator=torch.Generator().manual_seed(4))
    got = op.gated(x)
    h = x.double() @ w.t()
    want = F.silu(h[..., :24]) * h[..., 24:]
    scale = (x.double().abs() @ w.abs().t())
    bound = 64 * U32 * (scale[..., :24] * h[..., 24:].abs() + scale[..., 24:] * 2) + 8 * U32 * want.abs()
    assert got.shape == (5, 1, 24) and ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_threads(wdtype):
    op, _ = _operands(300, 99, wdtype, seed=5)
    x = torch.randn(8, 1, 99, generator=torch.Generator().manual_seed(6))
    together = op(x, threads=2)
    for m in range(8):
        for threads in (1, 2):
            assert torch.equal(op(x[m:m + 1], threads=threads), together[m:m + 1])
    assert torch.equal(op(x[2:5], threads=1), together[2:5])
    for rows in (5, 6, 7):  # one pass of 5 or 6 (bfloat16), or 4 and the rest
        assert torch.equal(op(x[:rows], threads=2), together[:rows])


def _fused_gelu(x, threads, bias=None):
    """GELU (tanh) of x [M, F] (+ bias [F]) as the kernel fuses it into a product (fc1's):
    x times the identity (each sum one exact term and zeros), the activation as its
    epilogue."""
    m, f = x.shape
    w, y = torch.eye(f), torch.empty_like(x)
    rc = D.load().tpk_linear(D.ptr(x), D.ptr(w), D.NULL, D.ptr(bias), D.NULL, D.ptr(y),
                             ctypes.c_int64(m), ctypes.c_int64(f), ctypes.c_int64(f),
                             D.INTS[D.DTYPES[x.dtype]], D.INTS[0],
                             D.INTS[1 + D.ACTS["gelu"]], D.INTS[threads])
    assert rc == 0
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_gelu_is_torchs_bit_for_bit(dtype):
    """The product's GELU (tanh) gives F.gelu's bits: Sleef's tanh where torch's vector
    loop runs, std::tanh on each chunk's tail (600 elements: 24 of them; 17500 at two
    threads: two chunks), one to eight rows, at one and two threads."""
    g = torch.Generator().manual_seed(7)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m, f in [(1, 3072), (8, 3072), (3, 200), (8, 1536), (7, 2500), (5, 333)]:
                x = (torch.randn(m, f, generator=g) * 3).to(dtype)
                want = F.gelu(x, approximate="tanh")
                assert torch.equal(_fused_gelu(x, threads), want), (threads, m, f)
    finally:
        torch.set_num_threads(before)
    special = torch.tensor([float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 1e30,
                            -1e30, 1e-40] * 4).to(dtype)  # through the bias: x is 0
    got = _fused_gelu(torch.zeros(1, 32, dtype=dtype), 1, special)
    torch.testing.assert_close(got[0], F.gelu(special, approximate="tanh"), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "layer", "rms+offset"])
def test_norms_match_float64(dtype, kind):
    g = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(4, 1, 99, generator=g) + 1).to(dtype)
    w = torch.randn(99, generator=g).to(dtype)
    b = torch.randn(99, generator=g).to(dtype) if kind == "layer" else None
    offset = 1.0 if kind == "rms+offset" else 0.0
    got = D.norm(x, w, b, 1e-5, offset)
    xd, wd = x.double(), w.double() + offset
    if kind == "layer":
        want = F.layer_norm(xd, (99,), wd, b.double(), 1e-5)
    else:
        want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    scale = want.abs() + wd.abs()
    tol = 64 * U32 * scale if dtype == torch.float32 else UBF * want.abs() + 64 * U32 * scale
    assert got.dtype == dtype and ((got.double() - want).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rd", [64, 32, 0])
def test_rope_and_cache_write_are_apply_rope_and_index_writes_bit_for_bit(dtype, rd):
    T, nq, nkv, hd = 3, 9, 3, 64
    g = torch.Generator().manual_seed(8)
    heads = torch.randn(T, nq + 2 * nkv, hd, generator=g).to(dtype)
    write = torch.tensor([3, 40, 63])
    qk = heads[:, :nq + nkv]
    angles = (None, None)
    if rd:
        cos, sin = rope_at(torch.tensor([[5], [17], [300]]), rd, 10000.0, 512)
        angles = (cos.view(T, 1, -1), sin.view(T, 1, -1))
        qk = apply_rope(qk, *angles)
    ck, cv = (torch.zeros(64, nkv, hd, dtype=dtype) for _ in range(2))
    got = heads.clone()
    D.rope_write(got, nq + nkv, nkv, *angles, write, ck, cv)
    assert torch.equal(got[:, :nq + nkv], qk) and torch.equal(got[:, nq + nkv:], heads[:, nq + nkv:])
    assert torch.equal(ck[write], qk[:, nq:]) and torch.equal(cv[write], heads[:, nq + nkv:])
    ck[write], cv[write] = 0, 0
    assert not ck.any() and not cv.any()  # nothing else written


GPT = get_preset("gpt2-tiny").with_(name="gpt-t", vocab_size=257, hidden=64, num_layers=2,
                                    num_heads=4, ffn=200, dropout=0.0)


@pytest.mark.parametrize("config", [SMOL, GPT], ids=["smol-swiglu", "gpt2-gelu-bias"])
def test_decode_only_model_takes_the_native_layer_and_is_as_accurate(monkeypatch, config):
    """Every decode step runs all its layers in one native call (`NativeStack`, counted),
    and the token-by-token logits are as close to the float64 model's full forward as the
    float32 full forward is (within 2x: random weights amplify float32 rounding)."""
    model = Transformer(config, ParallelMesh.single())
    fill(model, random_full(config, seed=5, scale=1.0), ParallelMesh.single())
    ids = torch.randint(0, 257, (3, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = copy.deepcopy(model).double()(ids)[:, 14:, :257]
        full = model(ids)[:, 14:, :257]
    for_decode(model)
    calls = []
    fast = native.NativeStack.__call__
    monkeypatch.setattr(native.NativeStack, "__call__",
                        lambda *a: calls.append(1) or fast(*a))
    with torch.no_grad():
        got = _decode_logits(model, ids, 14)[..., :257]
    assert len(calls) == 6  # 6 decode steps, every layer in one native call each

    def err(x):
        return ((x.double() - want).norm() / want.norm()).item()
    assert err(got) <= 2 * err(full) + 1e-6, (err(got), err(full))


@pytest.mark.parametrize("config", [SMOL, GPT], ids=["smol-swiglu", "gpt2-gelu-bias"])
def test_the_stack_the_layer_calls_and_the_modules_give_the_same_bits(monkeypatch, config):
    """float32, SwiGLU and GPT-2's GELU: a tp=1 step's layers in one native call
    (`NativeStack`), each layer's native calls from Python (`NativeLayer`) and the modules
    themselves (`Block` on the decode-only weights) run the same kernels on the same
    values in the same order (the residual added in float32 after the bias in all three;
    the stack's fused GELU is F.gelu's bits): the same logits bit for bit."""
    model = Transformer(config, ParallelMesh.single())
    fill(model, random_full(config, seed=5, scale=1.0), ParallelMesh.single())
    for_decode(model)
    ids = torch.randint(0, 257, (3, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        stack = _decode_logits(model, ids, 8)
        stacks.forget(model)
        monkeypatch.setattr(native.NativeStack, "of", classmethod(lambda cls, b, s: None))
        layers = _decode_logits(model, ids, 8)
        monkeypatch.setattr(native.NativeLayer, "of", classmethod(lambda cls, b: None))
        stacks.forget(model)  # no NativeLayer either: the modules
        modules = _decode_logits(model, ids, 8)
    assert torch.equal(stack, layers) and torch.equal(stack, modules)


def _stack_at_tp_worker(mesh, config, dtype):
    """At tp > 1 a decode step's layers in one native call, the all-reduces inside it,
    then each layer's calls from Python (`NativeLayer`, all-reduces between them): the
    logits of both, the stack's call count, each path's all-reduces in the ledger."""
    model = Transformer(config, mesh)
    fill(model, random_full(config, seed=5, scale=1.0), mesh)
    for_decode(model.to(dtype))
    assert mesh.tp_group.shm is not None  # the stack's all-reduce is the channel's
    ids = torch.randint(0, 257, (3, 12), generator=torch.Generator().manual_seed(6))
    calls, cls = [], native.NativeStack
    fast, of = cls.__call__, cls.__dict__["of"]

    def reduces():
        return [(r.scope, r.numel, r.nbytes) for r in mesh.ledger.records
                if r.op == "all_reduce" and r.scope.startswith("layers.") and r.numel == 3 * 72]
    try:
        cls.__call__ = lambda *a: calls.append(1) or fast(*a)
        with torch.no_grad():
            mesh.ledger.clear()
            stack = _decode_logits(model, ids, 8)
            on_stack = reduces()
            stacks.forget(model)
            cls.of = classmethod(lambda c, b, s: None)
            mesh.ledger.clear()
            layers = _decode_logits(model, ids, 8)
            by_layer = reduces()
    finally:
        cls.__call__, cls.of = fast, of
    return stack, layers, len(calls), on_stack, by_layer


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp, dtype", [(2, torch.float32), (3, torch.float32),
                                       (2, torch.bfloat16)], ids=["tp2", "tp3", "tp2-bf16"])
def test_the_stack_at_tp_sums_inside_its_call_as_the_layer_calls_do(run_tp, tp, dtype):
    """SmolLM2's shape (9 heads, 3 kv heads, ffn 99: uneven at tp=2, even at tp=3): at
    tp > 1 every decode step runs every layer in one native call (counted), the
    all-reduces on the shared-memory channel inside it; its logits are the per-layer
    path's bit for bit, its ledger the same all-reduces (2 a layer a step, one row of
    hidden values each, in each layer's scope: the theory), and in float32 the logits as
    close to the float64 tp=1 model's full forward as tp=1's float32 full forward is."""
    ids = torch.randint(0, 257, (3, 12), generator=torch.Generator().manual_seed(6))
    full = random_full(SMOL, seed=5, scale=1.0)
    want = Transformer(SMOL, ParallelMesh.single())
    fill(want, full, ParallelMesh.single())
    with torch.no_grad():
        f32 = want(ids)[:, 8:, :257]
        ref = want.double()(ids)[:, 8:, :257]

    def err(x):
        return ((x.double() - ref).norm() / ref.norm()).item()
    steps = 12 - 8
    size = torch.finfo(dtype).bits // 8
    for stack, layers, calls, on_stack, by_layer in run_tp(_stack_at_tp_worker, tp, SMOL,
                                                           dtype):
        assert calls == steps
        assert torch.equal(stack, layers)
        assert on_stack == by_layer
        assert on_stack == [(f"layers.{i}", 3 * 72, 3 * 72 * size) for _ in range(steps)
                            for i in range(SMOL.num_layers) for _ in range(2)]
        if dtype == torch.float32:
            assert err(stack[..., :257]) <= 2 * err(f32) + 1e-6, (err(stack), err(f32))


def _greedy_steps(model, ids, keep, allowed=None):
    """Greedy (token, log-probability) of the last positions of each row, one token at a
    time over the paged cache (`paged_kv.forward(greedy=True)`, each row's step masked by
    the bitmasks `allowed` [b, words] given), [b, n, 2]."""
    from tpkit.decode.paged_kv import LAST, NONE, PagedCache, Piece, forward

    b, s = ids.shape
    cache = PagedCache(model, 4)
    cache.grow(1 + b * 3)
    tables = [[1 + i + b * j for j in range(3)] for i in range(b)]
    rows = ids.tolist()
    forward(model, cache, [Piece(r[:keep], 0, t, NONE) for r, t in zip(rows, tables)])
    return torch.stack([forward(model, cache, [Piece([r[t]], t, tab, LAST) for r, tab in
                                               zip(rows, tables)], greedy=True,
                                allowed=allowed)[0] for t in range(keep, s)], 1)


def _ends_worker(mesh, config, dtype):
    """A greedy decode's steps with the ends in the stack's call (counted), then without
    (the final norm, head and best from Python): both results, the fused calls."""
    model = Transformer(config, mesh)
    fill(model, random_full(config, seed=5, scale=1.0), mesh)
    if dtype == "int8":
        for_decode(model, "int8")
    else:
        for_decode(model.to(dtype))
    ids = torch.randint(0, 257, (3, 12), generator=torch.Generator().manual_seed(6))
    ends, stack, fused = native.NativeEnds, native.NativeStack, []
    of = ends.__dict__["of"]

    def records():
        return sorted((r.op, r.scope or "", r.numel, r.nbytes) for r in mesh.ledger.records)
    with torch.no_grad():
        stacks.forget(model)
        go = stack._go  # every native call (the steps after the first are moved on)
        stack._go = lambda self, x, work, step, e, *a: (
            e is not None and fused.append(e.embeds)) or go(self, x, work, step, e, *a)
        try:
            mesh.ledger.clear()
            one_call = _greedy_steps(model, ids, 8)
            counts = [records()]
            masked = [_greedy_steps(model, ids, 8, MASK)]  # a grammar's, in the call
            stacks.forget(model)
            ends.of = classmethod(lambda c, m: None)
            mesh.ledger.clear()
            split = _greedy_steps(model, ids, 8)
            counts += [records()]
            masked.append(_greedy_steps(model, ids, 8, MASK))  # ... on the shards after
        finally:
            ends.of, stack._go = of, go
    return one_call, split, fused, counts, masked


MASK = torch.randint(-2**31, 2**31 - 1, (3, 9), dtype=torch.int32,  # 257 tokens' bits,
                     generator=torch.Generator().manual_seed(8))  # about half allowed


@pytest.mark.timeout(180)
@pytest.mark.parametrize("config, tp, dtype", [
    (SMOL, 1, torch.float32), (SMOL, 1, torch.bfloat16), (GPT, 1, torch.float32),
    (SMOL, 1, "int8"), (SMOL, 2, torch.float32), (GPT, 2, torch.bfloat16)],
    ids=["smol", "smol-bf16", "gpt2-positions", "smol-int8", "smol-tp2", "gpt2-tp2-bf16"])
def test_a_greedy_step_in_one_call_gives_the_tokens_and_logprobs_bit_for_bit(
        run_tp, config, tp, dtype):
    """`NativeEnds`: at tp=1 the embedding lookup (word table, GPT-2's learned positions
    added in the model's dtype) before the layers, on every rank the final norm, the
    head's product, the best of the shard and (tp > 1) their all-gather and pick after
    them, all in the stack's one call: the greedy tokens and log-probabilities are the
    modules' path's (`model.body`, the head, `paged_kv._greedy`) bit for bit, at tp=1 and
    tp=2 (the embedding's all-reduce and the all-gather inside the call), float32,
    bfloat16 and int8 weights; the ledger holds the same collectives on both paths."""
    ids = torch.randint(0, 257, (3, 12), generator=torch.Generator().manual_seed(6))
    for one_call, split, fused, (fast, slow), masked in run_tp(_ends_worker, tp, config,
                                                                 dtype):
        assert torch.equal(one_call, split), (one_call - split).abs().max()
        assert fused == [True] * 8  # every step took the one call, its embedding too
        assert torch.equal(masked[0], masked[1])  # a grammar's mask: the same bits
        ok = D.unpacked(MASK, 0, 257)
        assert all(ok[b, t] for b in range(3) for t in masked[0][b, :, 0].long().tolist())
        assert not torch.equal(masked[0][..., 0], one_call[..., 0])  # the mask mattered
        assert fast == slow  # the same collectives in the same scopes, counted alike
        steps = [r[:3] for r in fast]  # 4 steps of 3 decode rows: [tp * 3, 3] gathered
        assert steps.count(("all_gather", "", tp * 9)) == 4 * (tp > 1)
        assert steps.count(("all_reduce", "embed", 3 * config.hidden)) == 4 * (tp > 1)
        assert len(set(one_call[..., 0].flatten().tolist())) > 2  # not a degenerate row
        assert not torch.equal(one_call[:, :, 0].long(), ids[:, 8:])  # not the input back


def test_a_token_id_outside_the_embedding_is_named_by_the_one_call():
    model = Transformer(SMOL, ParallelMesh.single())
    fill(model, random_full(SMOL, seed=5, scale=1.0), ParallelMesh.single())
    for_decode(model)
    bad = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 900]])
    with torch.no_grad(), pytest.raises(Exception, match="token id 900 is outside"):
        _greedy_steps(model, bad, 9)


def _rank_dies_before_a_decode_step(mesh) -> None:
    import signal

    model = Transformer(SMOL, mesh)
    fill(model, random_full(SMOL, seed=5, scale=1.0), mesh)
    for_decode(model)
    ids = torch.randint(0, 257, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _decode_logits(model, ids, 4)  # the stack runs (prompt, then 2 steps)
        if mesh.rank == 1:  # rank 1 dies where it would enter the stack: rank 0 is inside
            D.run_layers = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        _decode_logits(model, ids, 4)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_dead_during_the_stacks_all_reduce_is_named_in_one_line():
    from tpkit.launch import SpawnError, spawn

    with pytest.raises(SpawnError) as info:  # a 60 s timeout: only the pid check is fast
        spawn(_rank_dies_before_a_decode_step, 2, mesh=dict(tp=2, comm="shm"),
              collective_timeout=60, timeout=100)
    line = str(info.value)
    assert "\n" not in line and line.startswith("rank 1 died (signal 9)"), line
    assert "then rank 0: all_reduce over tp [0, 1] (scope layers.0, forward)" in line, line
    assert "suspects: rank 1)" in line, line


def test_without_the_library_decode_weights_are_packed_as_before():
    code = ("import torch\n"
            "from tpkit.kernels import decode_ops\n"
            "from tpkit.decode.forms import for_decode, PackedWeight\n"
            "from tpkit.mesh import ParallelMesh\n"
            "from tpkit.model.transformer import Transformer\n"
            "from checkpoint_helpers import LLAMA\n"
            "assert decode_ops.load() is None\n"
            "m = for_decode(Transformer(LLAMA, ParallelMesh.single()))\n"
            "d = m.layers[next(iter(m.layers))].mlp.fc2.decoding\n"
            "assert d is None or isinstance(d, PackedWeight), d\n"
            "assert type(m.layers[next(iter(m.layers))].attn_norm).__name__ == 'Norm'\n"
            "print('ok')\n")
    env = {**os.environ, "TPKIT_DECODE_OPS_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_moved_step_is_a_fresh_steps_bits_and_two_caches_do_not_mix():
    """After a greedy step of decode rows the next on the same block tables is moved on in
    place (`paged_kv._moved`: positions, slots, ids, key ranges rewritten; the call's
    arguments kept). Steps moved on give the bits of steps laid out afresh, and two
    caches of one model decoding in turn (each re-points the model's shared ends) never
    run on the other's buffers."""
    from tpkit.decode import paged_kv
    from tpkit.decode.paged_kv import LAST, NONE, PagedCache, Piece, forward

    model = Transformer(SMOL, ParallelMesh.single())
    fill(model, random_full(SMOL, seed=5, scale=1.0), ParallelMesh.single())
    for_decode(model)
    rows = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(6)).tolist()

    def cache_of(prompt):
        cache = PagedCache(model, 4)
        cache.grow(4)
        forward(model, cache, [Piece(prompt[:6], 0, [1, 2, 3], NONE)])
        return cache

    def step(cache, prompt, t):
        return forward(model, cache, [Piece([prompt[t]], t, [1, 2, 3], LAST)], greedy=True)[0]

    with torch.no_grad():
        alone = []
        for prompt in rows:  # each alone, every step laid out afresh
            cache = cache_of(prompt)
            got = []
            for t in range(6, 12):
                cache.moving = None
                got.append(step(cache, prompt, t))
            alone.append(torch.cat(got))
        caches, moved = [cache_of(p) for p in rows], [[], []]
        for t in range(6, 12):  # in turn: a moved step only where its buffers are still its own
            for i, prompt in enumerate(rows):
                moved[i].append(step(caches[i], prompt, t))
                assert caches[i].moving is not None
    assert all(torch.equal(torch.cat(m), a) for m, a in zip(moved, alone))
    one = cache_of(rows[0])  # alone, the steps after the first are moved on
    calls = []
    laid = paged_kv.layout
    paged_kv.layout = lambda *a: calls.append(1) or laid(*a)
    try:
        with torch.no_grad():
            got = torch.cat([step(one, rows[0], t) for t in range(6, 12)])
    finally:
        paged_kv.layout = laid
    assert torch.equal(got, alone[0]) and len(calls) == 1


def test_a_table_grown_in_place_is_not_moved_on_with_the_old_one():
    """A caller that grows a row's block table in place (`serve.draft`'s `blocks +=`)
    between greedy steps: the step past the old table's blocks is laid out afresh, not
    moved on with the table the native call holds (it read past that table: row 0 read
    row 1's block, or past the plan and crashed), so every step gives a fresh step's
    bits; a table naming a block outside the cache, or too short for its tokens, is a
    ValueError naming it, not a read outside the cache."""
    from tpkit.decode.paged_kv import LAST, NONE, PagedCache, Piece, forward

    model = Transformer(SMOL, ParallelMesh.single())
    fill(model, random_full(SMOL, seed=5, scale=1.0), ParallelMesh.single())
    for_decode(model)
    rows = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(7)).tolist()

    def run(fresh):
        cache, tables = PagedCache(model, 4), [[1, 2], [4, 5, 6]]
        cache.grow(8)
        for prompt, table in zip(rows, tables):
            forward(model, cache, [Piece(prompt[:6], 0, table, NONE)])
        got = []
        for t in range(6, 12):
            if t == 8:
                tables[0] += [7]  # in place, as `Draft.propose` grows its table
            cache.moving = None if fresh else cache.moving
            got.append(forward(model, cache, [Piece([p[t]], t, b, LAST)
                                              for p, b in zip(rows, tables)], greedy=True)[0])
        return torch.cat(got), cache

    with torch.no_grad():
        (fresh, _), (moved, cache) = run(True), run(False)
        assert torch.equal(moved, fresh)
        for blocks, start, what in [([1, 8], 6, "names block 8, outside the cache's 8"),
                                    ([1, -1], 6, "names block -1"),
                                    ([1, 2], 8, "2 blocks of 4 hold 8 tokens, not its 9")]:
            with pytest.raises(ValueError, match=what):
                forward(model, cache, [Piece([5], start, blocks, LAST)], greedy=True)


@pytest.mark.parametrize("native, V", [(True, 100), (True, 1001), (False, 100)],
                         ids=["library", "library-wide", "torch"])
def test_a_grammars_mask_on_the_shards_is_torchs_masked_argmax(monkeypatch, native, V):
    """`shard_best(allowed=)`, each of tp = 1, 2, 3 shards masked by the same bitmask over
    the whole vocabulary, then `pick`: the first largest allowed token of the whole row
    (torch's argmax with -inf where not allowed: an allowed NaN wins, a disallowed one
    does not, none above -inf gives token 0), its log-probability the unmasked row's
    (log_softmax, within float32 round-off); a row of all ones is the unmasked best."""
    if not native:
        monkeypatch.setattr(D, "load", lambda: None)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, V, generator=g) * 4
    bits = torch.randint(-2**31, 2**31 - 1, (5, -(-V // 32)), dtype=torch.int32, generator=g)
    bits[1] = -1  # every token
    ok = D.unpacked(bits, 0, V)
    x[2, ok[2].nonzero()[7]] = float("nan")  # an allowed NaN: it wins
    x[3, (~ok[3]).nonzero()[0]] = float("nan")  # a disallowed one: not
    x[4, ok[4]] = float("-inf")  # every allowed token -inf: torch's argmax, token 0
    want = x.masked_fill(~ok, float("-inf")).argmax(-1)
    logp = x.log_softmax(-1).gather(1, want[:, None])[:, 0]
    for tp in (1, 2, 3):
        n = -(-V // tp)
        every = torch.cat([D.shard_best(x[:, r * n:(r + 1) * n].contiguous(), r * n, V, bits)
                           for r in range(tp)])
        got = D.pick(every, tp)
        assert torch.equal(got[:, 0].long(), want), (tp, got[:, 0], want)
        fine = [0, 1]  # (row 3: a NaN in the row, its log-sum-exp NaN)
        assert torch.allclose(got[fine, 1], logp[fine], rtol=1e-5, atol=0), tp
    assert torch.equal(D.shard_best(x, 0, V, bits)[1], D.shard_best(x, 0, V)[1])
