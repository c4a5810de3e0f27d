"""This process's random generators, captured into a checkpoint's `extra` and restored
after a load (torch on the run's device, and Python's), as plain JSON values."""

from __future__ import annotations

import random

import torch

from tpkit.host.device import rng_state, set_rng_state


def capture_rng(device: torch.device | None = None) -> dict:
    """This process's generator states (torch on `device`, Python), for `extra`."""
    version, state, gauss = random.getstate()
    return dict(torch=rng_state(device or torch.device("cpu")),
                python=[version, list(state), gauss])


def restore_rng(state: dict, device: torch.device | None = None) -> None:
    """Restore what `capture_rng` returned (after a load)."""
    set_rng_state(state["torch"], device or torch.device("cpu"))
    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))
