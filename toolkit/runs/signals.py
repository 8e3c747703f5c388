"""Ctrl-C and SIGTERM taken between an engine loop's steps: what record() and the soaks share.

A loop runs inside `stop_between_steps()`, reads `stop.pressed` before each step, and on a stop closes its trace,
writes its report (naming `stop.name`) and raises `stop.interrupted(...)`: the one line the CLI prints, with the
signal's own exit code."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from toolkit.errors import Interrupted

DEFAULT_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


class StopRequest:
    """Whether a signal asked the loop to stop, and which."""

    pressed = False
    signum = signal.SIGINT  # the signal that asked the run to stop

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def interrupted(self, message: str) -> Interrupted:
        """The Interrupted to raise once the loop's trace and report are on disk: exit code 128 + the signal's
        number (130 for Ctrl-C, 143 for SIGTERM), as the signal's own death."""
        stopped = Interrupted(message)
        stopped.exit_code = 128 + self.signum
        return stopped


@contextlib.contextmanager
def stop_between_steps() -> Iterator[StopRequest]:
    """Ctrl-C while the engine steps only sets a flag, which the loop reads between steps: a KeyboardInterrupt
    raised at an arbitrary bytecode can land inside the trace writer's queue (threading.Condition.notify between
    dropping a waiter and waking it) and leave close() waiting forever. A second Ctrl-C interrupts at once.
    SIGTERM (what `timeout`, Slurm and `docker stop` send) stops the run the same way where nothing else handles it:
    by default it killed the process with up to a flush of rows unwritten and no summary."""
    state = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield state  # not ours to change (a worker thread)
        return
    ours = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is DEFAULT_HANDLERS[s]]

    def handler(signum, frame):
        if state.pressed:
            raise KeyboardInterrupt
        state.pressed, state.signum = True, signum

    for s in ours:  # not a server's handler, nor a signal someone ignores
        signal.signal(s, handler)
    try:
        yield state
    finally:
        for s in ours:
            signal.signal(s, DEFAULT_HANDLERS[s])
