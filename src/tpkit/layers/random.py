"""Tensor-parallel random numbers (Megatron's RNG tracker, without global state).

Dropout on activations that every tp rank holds identically (the residual stream
without sequence parallelism) must draw the same mask on every rank: it uses the
default generator, seeded identically across tp. Dropout on activations split over
tp (attention heads; the sequence slices of sequence parallelism) must draw
different masks on different ranks, or the model would be a different model at
each tp: it runs inside `rng.fork()`, a generator seeded per tp rank.

`checkpointed(fn, rng, *args)` recomputes `fn` in backward (activation
recomputation) after restoring both generators, so the recomputed dropout masks
equal the original ones.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tpkit.host.device import rng_state, set_rng_state

_TP_SEED_OFFSET = 2718


class TPRandom:
    """The per-tp-rank generator state for dropout on sharded activations."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        saved = rng_state(self.device)
        torch.manual_seed(seed + _TP_SEED_OFFSET + 101 * tp_rank)
        self.state = rng_state(self.device)
        set_rng_state(saved, self.device)

    @contextmanager
    def fork(self):
        """Draw from this rank's own generator inside the block."""
        saved = rng_state(self.device)
        set_rng_state(self.state, self.device)
        try:
            yield
        finally:
            self.state = rng_state(self.device)
            set_rng_state(saved, self.device)

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(default generator, tp generator) states."""
        return rng_state(self.device), self.state.clone()

    def set_states(self, states: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Restore what `states` returned."""
        set_rng_state(states[0], self.device)
        self.state = states[1].clone()


def dropout(x: torch.Tensor, p: float, training: bool, rng: TPRandom | None,
            sharded: bool) -> torch.Tensor:
    """Dropout with the right generator: per-rank when `x` is split over tp."""
    if p == 0.0 or not training:
        return x
    if sharded and rng is not None:
        with rng.fork():
            return torch.nn.functional.dropout(x, p, True)
    return torch.nn.functional.dropout(x, p, True)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, rng, *args):
        ctx.fn, ctx.rng = fn, rng
        ctx.states = rng.states() if rng is not None else (rng_state(args[0].device), None)
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = [a.detach().requires_grad_(a.requires_grad) for a in ctx.saved_tensors]
        rng, device = ctx.rng, args[0].device
        now = rng.states() if rng is not None else (rng_state(device), None)
        if rng is not None:
            rng.set_states(ctx.states)
        else:
            set_rng_state(ctx.states[0], device)
        with torch.enable_grad():
            out = ctx.fn(*args)
        if rng is not None:
            rng.set_states(now)
        else:
            set_rng_state(now[0], device)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward([o for o in outs if o.requires_grad],
                                [g for o, g in zip(outs, grads) if o.requires_grad])
        return (None, None, *[a.grad if a.requires_grad else None for a in args])


def checkpointed(fn, rng: TPRandom | None, *args: torch.Tensor):
    """Run `fn(*args)` without keeping activations; recompute it in backward with the
    same random numbers (both generators restored)."""
    return _Checkpoint.apply(fn, rng, *args)
