"""What torchrun's agents must be told for a run over hosts to survive losing one.

torchrun restarts the workers (`--max-restarts`) and, with the c10d rendezvous, admits a
host that comes back; tpkit's part is the rest (`--resume auto` from the newest complete
checkpoint, decided by rank 0). One agent setting stands in the way: by default (torch
2.4 and later) the agents share the rendezvous store with the workers, and an agent that
stayed up keeps the previous round's store address while a restarted one waits for the
new round's, forever (pytorch/pytorch#135712). `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in
the agents' environment makes every round publish its own; the workers inherit that
environment, so rank 0 can tell, at start-up, a run that could not take a host back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def restart_advice(resume_auto: bool, env: Mapping[str, str] | None = None) -> str | None:
    """One warning line when torchrun restarts this run (`--max-restarts`) but a restart
    could not continue it: without `--resume auto` (a restart would refuse the run folder
    its first incarnation wrote), or over several hosts sharing the agents' store (a lost
    host could not rejoin); else None."""
    env = os.environ if env is None else env
    hosts = int(env.get("GROUP_WORLD_SIZE") or 1)
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    if restarts < 1:
        return None
    fixes = [] if resume_auto else ["run tpkit with --resume auto (a restart continues "
                                    "from the newest complete checkpoint)"]
    if hosts > 1 and env.get(SHARED_STORE) != "1":
        fixes.append(f"start every agent with {SHARED_STORE}=1 and --rdzv-backend c10d (a "
                     f"lost host's new agent would wait forever for the shared store)")
    if not fixes:
        return None
    return (f"warning: torchrun --max-restarts {restarts} over {hosts} "
            f"host{'s' * (hosts > 1)}, but a restart could not continue this run: "
            + "; ".join(fixes))
