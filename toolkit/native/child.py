"""Foreign native code (llama.cpp) runs in a child process: its crash is an error of the caller's, never its death.

    run_in_child(fn, *args, what="llama.cpp", timeout=600)   # fn's result, or ForeignEngineError in one line

`fn` must be a module-level function (it is pickled into a "spawn" child: nothing of the caller's state, threads
or native libraries is inherited). The parent polls the child, so a child that dies of a signal, exits without
a result, raises, or runs past `timeout` is noticed at once and named.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from toolkit.errors import ForeignEngineError, one_line


def _child(conn, fn: Callable, args: tuple, kwargs: dict) -> None:
    try:
        result = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent as one line; the traceback to stderr
        traceback.print_exc()
        result = ("error", one_line(exc))
    conn.send(result)
    conn.close()


def run_in_child(fn: Callable, *args: Any, what: str, timeout: float | None = None, **kwargs: Any) -> Any:
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args, kwargs), name=f"{what} child", daemon=True)
    proc.start()
    send.close()  # the child holds the only sending end: its death closes the pipe
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not receive.poll(0.05):
            if not proc.is_alive() and not receive.poll(0):
                raise ForeignEngineError(f"{what} {exit_reason(proc.exitcode)}")
            if deadline is not None and time.monotonic() > deadline:
                raise ForeignEngineError(f"{what} ran past its {timeout:g} s timeout and was killed")
        try:
            status, value = receive.recv()
        except EOFError:
            proc.join(5)
            raise ForeignEngineError(f"{what} {exit_reason(proc.exitcode)}") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        receive.close()
    if status == "error":
        raise ForeignEngineError(f"{what} failed: {value}")
    return value


def exit_reason(exitcode: int | None) -> str:
    """How a child process ended, from its exit code, as the end of a sentence ("crashed: killed by signal ...")."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"crashed: killed by signal {name} ({-exitcode}) in its child process"
    return f"exited with code {exitcode} in its child process without a result"
