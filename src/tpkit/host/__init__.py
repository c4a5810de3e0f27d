"""The machine this process runs on, and how its processes end.

    device.py           the one place that touches CUDA: backend, device per rank
    memory.py           what the machine or its cgroup offers, OOM kills, peak RSS
    elastic.py          what torchrun's agents need for a run to survive a lost host
    exit.py             end a process once its work is cleaned up, without the teardown;
                        `Stopped`, the signal that unwinds it
    stop.py             a stop honoured at the next safe point (train's step boundary)
    forkserver_exit.py  the same for the multiprocessing forkserver (preloaded there)
    forkserver.py       that forkserver, which every worker is forked from: what it
                        preloads; `tpkit train` starts it before it imports torch
    addresses.py        which Host headers a local HTTP server accepts (quiz, serve)
    web.py              what those servers share: the Host and origin rule, listening

Nothing here imports the rest of tpkit but `tpkit.spec.errors`; only `device.py` imports
torch (this package's `__init__` imports nothing, so `tpkit.cli` reaches `exit.py`
without torch).
"""
