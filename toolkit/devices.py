"""Host values onto the device without waiting for it.

torch's copy of a CPU tensor into a CUDA one, unless non-blocking from page-locked memory, synchronises the stream:
the host waits until every kernel queued so far has run. A decode step makes a dozen such copies (its token
buffers, the processors' parameter columns, the rows a processor runs on, the sampler's keys), so each one drained
the queue; with async scheduling (toolkit/engine/ahead.py) the queue holds the next step's forward, and the host
would wait for it instead of committing beside it. `tensor_on` copies through page-locked memory, non-blocking
(torch's caching host allocator keeps that memory until the copy has run). On the CPU it is torch.tensor.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_WIDENED = False  # device_route: every tensor takes the device's route


def off_cpu(t: torch.Tensor) -> bool:
    """Whether a step's host code takes the device's route for `t` (its work queued, its results read once) rather
    than the CPU's (native kernels, a row at a time). The one test of it, so that device_route can widen it."""
    return _WIDENED or t.device.type != "cpu"


@contextlib.contextmanager
def device_route() -> Iterator[None]:
    """While entered, a step's host code takes the device's route on CPU tensors (off_cpu widened) with the native
    CPU kernels off (TOOLKIT_NATIVE=0); then both are as they were. What a GPU's host runs, run and timed where no GPU
    is (tests/test_async_scheduling.py; toolkit.bench.host_step --route device)."""
    global _WIDENED
    widened, env = _WIDENED, os.environ.get("TOOLKIT_NATIVE")
    _WIDENED, os.environ["TOOLKIT_NATIVE"] = True, "0"
    try:
        yield
    finally:
        _WIDENED = widened
        if env is None:
            del os.environ["TOOLKIT_NATIVE"]
        else:
            os.environ["TOOLKIT_NATIVE"] = env


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on `device`; onto a CUDA device without waiting for the work queued there."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_on(
    values: Sequence[Any] | Any, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), without waiting for the work queued on a CUDA device."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a CPU `src`, without waiting for the work queued on a CUDA `dst`'s device."""
    if dst.is_cuda and not src.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
