"""The transports a group may use, and how a run chooses (pure Python: flags and env).

    --comm auto   (default) shared memory for every group whose ranks share a host and a
                  node of the rank grid; gloo (NCCL on GPUs) for the others
    --comm shm    the same, but an error if the shared-memory kernels are missing
    --comm gloo   torch.distributed for every group (the reference)

Under torchrun the choice comes from TPKIT_COMM. `tpkit.comm.transport` applies it.
"""

from __future__ import annotations

import os

from tpkit.spec.errors import UserError

COMM_CHOICES = ("auto", "shm", "gloo")
COMM_HELP = ("transport of the groups whose ranks share a host: auto (shared memory there, "
             "gloo/NCCL across hosts), shm (the same, an error if its kernels are missing), "
             "gloo (torch.distributed everywhere); TPKIT_COMM under torchrun (default: auto)")


def comm_choice(comm: str | None = None) -> str:
    """`comm`, else TPKIT_COMM, else "auto"; checked."""
    value = comm or os.environ.get("TPKIT_COMM") or "auto"
    if value not in COMM_CHOICES:
        raise UserError(f"comm={value!r} is not one of {', '.join(COMM_CHOICES)} "
                        f"(--comm or TPKIT_COMM)")
    return value


def add_comm_argument(parser) -> None:
    """`--comm auto|shm|gloo` on a command that spawns ranks (default: TPKIT_COMM, else auto)."""
    parser.add_argument("--comm", choices=list(COMM_CHOICES), default=None, help=COMM_HELP)
