"""The OS name of a thread this package starts: what `top -H`, `ps -L`, py-spy and /proc/<pid>/task/*/comm show.

Python names its threads for itself only; the OS keeps the process's name ("python") for all of them, so a
profile of a server cannot tell the engine's thread from the event loop's. Linux keeps up to 15 bytes a thread,
and a thread the named one starts afterwards inherits the name: the engine thread's OpenMP workers (started by its
first parallel region) are "engine-loop" too, so a served step's CPU reads off one name
(toolkit.bench.one_stream prints it per token).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from functools import lru_cache

PR_SET_NAME = 15  # prctl(2)
NAME_BYTES = 15  # what the kernel keeps of a thread's name


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def name_current_thread(name: str | None = None) -> bool:
    """Give the calling thread `name` (default: its Python name) as its OS name, cut to 15 bytes; whether the OS
    took it (False off Linux: a name is a diagnostic, never needed)."""
    libc = _libc()
    if libc is None:
        return False
    raw = (name or threading.current_thread().name).encode()[:NAME_BYTES]
    return libc.prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0


def yield_to_the_step(nice: int = 10) -> bool:
    """Lower the calling thread's CPU priority by `nice` (Linux keeps a nice value a thread): for work beside the
    engine's step that no token waits on (the trace writer's Arrow and Parquet encoding). On a machine whose every
    core runs the step's threads, such work preempted one of them for its whole burst, and the step's next barrier
    waited for it; at a lower priority it takes the cores' gaps first. Nice 10 still gets about a tenth of a core
    against a saturating thread, so it keeps up when the machine is busy. Whether the OS took it (False off Linux,
    or where the thread's priority cannot change: it is an optimisation, never needed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
    except OSError:
        return False
    return True
