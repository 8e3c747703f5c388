"""sha256 of rows in C: the digests of logits rows a trace records, on every thread, or beside Python's own work."""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from toolkit.native.library import KernelUnavailable, NativeLib, resolve_or_none

T = TypeVar("T")


SHA_METHODS = ("auto", "lanes", "sha_ni")


def sha256_rows(
    rows_RB,
    index: list[int] | None = None,
    threads: int | None = None,
    lib: NativeLib | None = None,
    method: str = "auto",
) -> list[str]:
    """The sha256 hex digest of the bytes of each row of a 2-D CPU tensor or numpy array (rows
    `index`, all by default), read in place, in C on `threads` threads (default torch's): a build's
    lanes of rows per pass, or, on a CPU with the x86 SHA extensions, up to 4 rows interleaved per
    thread (`method` "lanes" / "sha_ni"; "auto" takes the one _sha_costs predicts faster for these
    rows). The digests hashlib gives; hashlib row by row for one or two rows or without the native
    kernels."""
    job = _sha_job(rows_RB, index, threads, lib, method)
    if isinstance(job, list):
        return job
    lib, x, index, threads, method, offsets, out = job
    lib.fn["sha256_rows_ni" if method == "sha_ni" else "sha256_rows"](
        x.data_ptr(), offsets.ctypes.data, len(index), x.shape[1] * x.element_size(), out.ctypes.data, threads
    )
    return _hexes(out)


class ShaJob:
    """The sha256 hex digests of rows of a 2-D CPU tensor or numpy array (rows `index`, all by default), hashed
    in parts: `beside(fn)` runs fn on this thread while the other threads hash, as far as they get before fn
    returns (Python's own work on one core, beside hashing that would otherwise leave it alone), and may be
    called several times; `digests()` hashes what is left on every thread and returns what sha256_rows would.
    The rows must not change until then. Where the kernels do not run (or for one or two rows) beside(fn) is
    fn() and digests() hashes every row. An exception from fn is raised after the other threads stop. Calls
    from different threads take turns (a lock): a group of rows is never hashed by two calls at once."""

    def __init__(
        self,
        rows_RB,
        index: list[int] | None = None,
        threads: int | None = None,
        lib: NativeLib | None = None,
        method: str = "auto",
    ):
        job = _sha_job(rows_RB, index, threads, lib, method)
        self._done = job if isinstance(job, list) else None
        self._lock = threading.Lock()
        self._inside: int | None = None  # the thread running fn in beside(), while it does
        if self._done is None:
            self._lib, self._x, index, self._threads, method, self._offsets, self._out = job
            self._rows, self._method = len(index), int(method == "sha_ni")
            # the SHA path: up to 4 rows a group, fewer where that keeps every thread busy at the end
            self._group_rows = min(4, -(-self._rows // self._threads)) if self._method else self._lib.profile.lanes
            groups = -(-self._rows // self._group_rows)
            self._state = np.zeros(groups * self._lib.sha_group_bytes, np.uint8)

    def _call(self, callback) -> int:
        return self._lib.fn["sha256_job"](
            self._x.data_ptr(),
            self._offsets.ctypes.data,
            self._rows,
            self._x.shape[1] * self._x.element_size(),
            self._out.ctypes.data,
            self._threads,
            self._method,
            self._group_rows,
            self._state.ctypes.data,
            callback,
        )

    def beside(self, fn: Callable[[], T]) -> T:
        if self._done is not None:
            return fn()
        result: list = []

        def call() -> int:
            try:
                result.append(fn())
            except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's side of the C call
                result.append(exc)
            return 0

        callback = _TASK(call)  # kept alive for the whole call
        self._check_not_inside()
        with self._lock:
            if self._done is not None:  # hashed meanwhile (by digests() on another thread)
                return fn()
            self._inside = threading.get_ident()
            try:
                if self._call(callback) != 0 or not result:
                    raise ValueError("sha256 job: bad arguments")
            finally:
                self._inside = None
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def digests(self) -> list[str]:
        self._check_not_inside()
        with self._lock:
            if self._done is None:
                if self._call(None) != 0:
                    raise ValueError("sha256 job: bad arguments")
                self._done = _hexes(self._out)
        return self._done

    def _check_not_inside(self) -> None:
        if self._done is None and self._inside == threading.get_ident():
            raise RuntimeError("a ShaJob's beside(fn) or digests() called from inside its own fn")


_TASK = ctypes.CFUNCTYPE(ctypes.c_int)


def _sha_job(rows_RB, index, threads, lib, method):
    """sha256_rows' arguments checked and resolved: the digests themselves (hashlib's) where the kernels do
    not run, else (lib, rows, index, threads, method, byte offsets, output)."""
    if method not in SHA_METHODS:
        raise ValueError(f"sha256_rows: method must be one of {SHA_METHODS}, got {method!r}")
    x = torch.from_numpy(rows_RB) if not isinstance(rows_RB, torch.Tensor) else rows_RB
    if x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"sha256_rows wants a 2-D CPU array, got shape {tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    whole = index is None
    index = range(x.shape[0]) if whole else [int(i) for i in index]
    if not whole and any(not 0 <= i < x.shape[0] for i in index):
        raise IndexError(f"sha256_rows: a row index is outside the {x.shape[0]} rows")
    # a pass of the build's lanes costs about what hashlib takes for two rows
    lib = resolve_or_none(lib) if len(index) > 2 or method != "auto" else None
    if lib is None:
        return [hashlib.sha256(x[i].numpy().view("uint8")).hexdigest() for i in index]
    threads = threads or torch.get_num_threads()
    if method == "sha_ni" and not lib.sha_ni:
        raise KernelUnavailable("this CPU has no SHA extensions (sha256_rows method='sha_ni')")
    if method == "auto":
        method = "sha_ni" if lib.sha_ni and _sha_ni_faster(lib, len(index), threads) else "lanes"
    offsets = (np.arange(len(index), dtype=np.int64) if whole else np.array(index, dtype=np.int64)) * (
        x.stride(0) * x.element_size()
    )
    return lib, x, index, threads, method, offsets, np.empty((len(index), 32), np.uint8)


def _hexes(out: np.ndarray) -> list[str]:
    hexes = out.tobytes().hex()
    return [hexes[64 * i : 64 * i + 64] for i in range(out.shape[0])]


def _sha_costs(lib: NativeLib) -> tuple[float, float]:
    """Seconds, on one thread, of a lanes pass (the build's lanes of rows) and of one row with the SHA
    extensions (4 interleaved), for 128 KiB rows (a logits row is 196 KiB; smaller rows would sit in a
    cache the real ones do not): measured once per build, best of three (~2 ms)."""
    if lib.sha_costs is None:
        lanes = lib.profile.lanes
        data = torch.zeros((max(lanes, 4), 131072), dtype=torch.uint8)
        offsets = torch.arange(data.shape[0], dtype=torch.int64) * data.shape[1]
        out = torch.empty((data.shape[0], 32), dtype=torch.uint8)
        best = []
        for fn, rows in (("sha256_rows", lanes), ("sha256_rows_ni", 4)):
            times = []
            for _ in range(3):
                start = time.perf_counter()
                lib.fn[fn](data.data_ptr(), offsets.data_ptr(), rows, data.shape[1], out.data_ptr(), 1)
                times.append(time.perf_counter() - start)
            best.append(min(times))
        lib.sha_costs = (best[0], best[1] / 4)
    return lib.sha_costs


def _sha_ni_faster(lib: NativeLib, rows: int, threads: int) -> bool:
    """Whether `rows` rows on `threads` threads hash sooner with the SHA extensions than in lanes (the
    work of the busiest thread under each path's split of the rows, toolkit/csrc/sha256_rows.c)."""
    per_pass, per_row = _sha_costs(lib)
    groups = -(-rows // lib.profile.lanes)
    lanes_s = -(-groups // min(threads, groups)) * per_pass
    per = min(4, -(-rows // threads))
    ni_groups = -(-rows // per)
    return -(-ni_groups // min(threads, ni_groups)) * per * per_row < lanes_s
