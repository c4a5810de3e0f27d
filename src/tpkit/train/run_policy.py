"""The run-folder policy, one for `tpkit train` and for `tpkit.train.train()` from Python:

    with run_folder(cfg, mesh) as cfg:   # cfg.resume: one checkpoint directory, or None
        ...                              # the run; the folder is this run's until it ends

Decided once (`launch.decided_by_rank0`): by the launcher before any rank starts (mesh
None, or a mesh of one rank), or by rank 0 of a world already running (torchrun's,
`tpkit.spawn`'s), every rank getting its answer or its one UserError line:

1. the checkpoint to resume (`resume_dir`): "auto" the newest valid one in `cfg.out`
   (none: a fresh run; the newest hashed once, by the decider), a run folder its latest;
   what differs from the checkpoint's
   config is said, a change that cannot work (another model) refused;
2. the folder checked and locked for the run (`run_folder.check_writable`, `hold`);
3. another run's checkpoints there refused, or (a new run, `overwrite`) deleted
   (`run_folder.earlier_runs`);
4. `check(cfg)`, the launcher's last checks (the command's: data, memory), then the
   run's config written to `cfg.out/config.toml`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tpkit.checkpoint.retention import discard
from tpkit.launch import decided_by_rank0
from tpkit.mesh import ParallelMesh
from tpkit.train.config import TrainConfig
from tpkit.train.config_file import resume_changes, saved_config, write_run_config
from tpkit.train.run_folder import check_writable, earlier_runs, hold
from tpkit.weights.paths import latest, run_checkpoints, sharded_dir


@contextmanager
def run_folder(cfg: TrainConfig, mesh: ParallelMesh | None, overwrite: bool = False,
               check: Callable[[TrainConfig], None] | None = None) -> Iterator[TrainConfig]:
    """Hold `cfg.out` for one run (the steps above); yields the config with the resume
    chosen. Call on every rank of `mesh` (None: the launcher, before any rank starts)."""
    decider = mesh if mesh is not None and mesh.world_size > 1 else None
    lead = mesh is None or mesh.rank == 0
    cfg = cfg.with_(resume=decided_by_rank0(decider, resume_dir, cfg))
    note = _resume_note(cfg)
    with ExitStack() as stack:
        def take() -> None:
            check_writable(Path(cfg.out))  # one line, before any process is spawned
            stack.enter_context(hold(Path(cfg.out)))  # one run per folder, until it ends

        decided_by_rank0(decider, take)
        for d in earlier_runs(Path(cfg.out), cfg.resume, overwrite):
            if lead:  # --overwrite: the earlier run's checkpoints go
                discard(d)
        if note and lead:  # once the folder is known to be this run's
            print(note, file=sys.stderr)
        if check is not None:
            check(cfg)
        if lead:
            write_run_config(cfg, cfg.out)
        yield cfg


def resume_dir(cfg: TrainConfig) -> str | None:
    """The checkpoint directory `cfg.resume` names: "auto", the newest valid one in
    --out (None: a fresh run); a run folder, its latest valid checkpoint."""
    if cfg.resume == "auto":
        found = latest(run_checkpoints(cfg.out))
        return None if found is None else str(found)
    return cfg.resume and str(sharded_dir(cfg.resume))


def _resume_note(cfg: TrainConfig) -> str | None:
    """A resumed run (`cfg.resume`: the checkpoint directory `resume_dir` chose): the
    line saying what differs from the checkpoint's config (said once the folder is
    known to be this run's); a change that cannot work (another model, another data
    order) is a UserError, now, on every rank."""
    saved = saved_config(cfg.resume) if cfg.resume else None
    changes = resume_changes(saved, cfg) if saved is not None else []
    return f"resuming {cfg.resume} with changes: " + "; ".join(changes) if changes else None
