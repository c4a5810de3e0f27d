"""Preloaded by the multiprocessing forkserver that `tpkit.launch` starts, and imported
nowhere else: it makes the forkserver end without the interpreter's teardown.

The forkserver (torch loaded, to fork workers fast) exits when its launcher is gone,
SIGKILL included; tearing torch down then takes seconds on a busy machine, during
which a process outlives the run. Nothing of the forkserver needs that teardown: it
holds no file, semaphore or child of its own once the workers are gone (they exit
through `os._exit`, never through the exit handlers, so this one never runs in them).
"""

import atexit
import os

atexit.register(os._exit, 0)  # registered last, so it runs first: the forkserver's exit
