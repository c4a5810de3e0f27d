"""How a stopped or failed `tpkit train` continues, said at the end of its one line:

    tpkit train: stopped by SIGINT: saved step 173 in runs/train/checkpoints/step_000173;
        continue with: tpkit train --tp 2 --pp 2 --steps 3000 --resume auto
    tpkit train: error: rank 2 died ... last step completed: 465; newest checkpoint:
        runs/train/checkpoints/step_000400; continue with: torchrun ... --resume auto

The command is the user's own (their flags, `--resume` and `--overwrite` replaced by
`--resume auto`); under torchrun, the agent's command line (its flags) in front.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from tpkit.host.forkserver import under_torchrun_env
from tpkit.spec.errors import RunFailed
from tpkit.weights.paths import newest_whole, run_checkpoints

_DROPPED = {"--resume": 1, "--overwrite": 0}  # flag -> how many values follow it


def continues(e: BaseException) -> bool:
    """Whether `e` ends a run that `--resume auto` can continue: a stop (a signal), a
    dead or stuck peer, a failed run; not a user mistake."""
    original = getattr(e, "original", None)
    return any(isinstance(x, (KeyboardInterrupt, RunFailed)) or
               getattr(x, "run_failed", False) for x in (e, original))


def continue_hint(out: str | Path, e: BaseException) -> str:
    """'; continue with: CMD', after the newest complete checkpoint in `out` unless the
    stop itself says which it saved."""
    stopped = e if isinstance(e, KeyboardInterrupt) else getattr(e, "original", None)
    if str(getattr(stopped, "said", "")).startswith(": saved step"):
        return f"; continue with: {resume_command()}"
    newest = newest_whole(run_checkpoints(out))
    where = f"; newest checkpoint: {newest}" if newest else "; no checkpoint yet"
    return f"{where}; continue with: {resume_command()}"


def resume_command(argv: list[str] | None = None, agent: list[str] | None = None) -> str:
    """The command line that continues this run: `argv` (default: this process's), its
    --resume and --overwrite dropped, `--resume auto` added; under torchrun `agent`'s
    (default: the parent process's) in front of `-m tpkit`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], 0
    for word in argv:
        flag = word.split("=", 1)[0]
        if skip:
            skip -= 1
        elif flag in _DROPPED:
            skip = _DROPPED[flag] if "=" not in word else 0
        else:
            kept.append(word)
    head = _launcher(agent)
    return shlex.join([*head, *kept, "--resume", "auto"])


def _launcher(agent: list[str] | None) -> list[str]:
    """What runs `tpkit`: `tpkit`, or torchrun and its flags then `-m tpkit`."""
    if agent is None and under_torchrun_env() is not None:
        agent = _parent_argv()
    if not agent:
        return ["tpkit"]
    start = next((i for i, w in enumerate(agent) if Path(w).name.startswith("torchrun") or
                  w == "torch.distributed.run"), None)
    end = next((i for i, w in enumerate(agent) if w == "tpkit"), None)
    if start is None or end is None or end < start:
        return ["torchrun", "...", "-m", "tpkit"]
    return ["torchrun", *agent[start + 1:end + 1]]


def _parent_argv() -> list[str]:
    """The parent process's command line (torchrun's agent), from /proc; [] elsewhere."""
    try:
        from os import getppid

        with open(f"/proc/{getppid()}/cmdline", "rb") as f:
            return [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return []
