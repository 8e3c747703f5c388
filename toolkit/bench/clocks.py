"""Clocks of a step's parts for the benchmarks: the seconds in the model's forward (ForwardClock,
toolkit.bench.host_step) and the host's seconds waiting for a CUDA device (WaitClock, toolkit.bench.gpu), so that a
step's time splits into the host's own work and the rest."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class ForwardClock:
    """Wraps a model's forward and adds up the seconds spent in it."""

    def __init__(self, model: torch.nn.Module):
        self.seconds = 0.0
        self.inner: Callable[..., Any] = model.forward
        model.forward = self  # the instance's attribute: nn.Module.__call__ calls it

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


class WaitClock:
    """The host's seconds in `torch.cuda.Event.synchronize` while it is entered: a step's one wait for the device
    (the sampler's results; toolkit/devices.py keeps every other copy from waiting). A step's time less its wait is
    the host's own work: where that is most of the step, the host bounds it, else the GPU."""

    def __init__(self):
        self.seconds = 0.0
        self._synchronize = None

    def _timed(self, event: torch.cuda.Event) -> None:
        t = time.perf_counter()
        try:
            self._synchronize(event)
        finally:
            self.seconds += time.perf_counter() - t

    def __enter__(self) -> WaitClock:
        clock, self._synchronize = self, torch.cuda.Event.synchronize
        torch.cuda.Event.synchronize = lambda event: clock._timed(event)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.Event.synchronize = self._synchronize  # type: ignore[method-assign]
