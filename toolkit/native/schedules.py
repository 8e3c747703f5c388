"""Which loops the packed matmul runs for a step's rows (csrc/matmul_invariant.c's schedules), chosen per class of
rows by a short measurement at first use, and kept per CPU and kernel build.

Every schedule gives the same bits (each output one FMA chain over k in order; tests/test_schedules.py holds them
to it), so the choice is speed alone: how the weights stream. Which is fastest depends on the CPU (its memory,
its prefetchers, its vector width), the rows and the threads, so it is measured, not assumed:

    tiles  panel by panel in blocks of k, row tiles over each block (the general path)
    pairs  two panels at a time, the whole of k in one pass, rows two at a time
    quads  four panels at a time, the whole of k in one pass, a row at a time

each with the kernel's software prefetch of the weights ahead, or with `-nopf` without it (the hardware prefetcher
alone: on a Zen 4, 2 cores, a row at a time over SmolLM2's LM head streamed 54-67 GB/s without, 34-38 with; on the
AVX2 EPYC the prefetch was what kept 10 and 16 rows fed).

The classes of rows: a decode step at batch 1, a few rows (2-4), a small batch (5-16); more rows (prefill, big
batches) always run tiles, whose x slab and k blocks are built for them. `engine.matmul_schedule`:

    auto   measured at first use on the model's own packed weights (each schedule timed over the same weights,
           interleaved, the fastest of three rounds kept), the choice cached in $TOOLKIT_CACHE/kernels under a key
           of the CPU, the build's library, the threads, the weights' format and shapes; batch_invariant=true
           keeps the fixed choice instead (its guarantee rests on no measurement)
    fixed  pairs for one row, tiles for more (the schedule before the choice existed)
    tiles | pairs | quads   that one for every class (a benchmark's deliberately wrong choice)

The run's manifest records the choice and how it was made (`matmul_schedule`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass

import torch

from toolkit.native.cpu import cpu_flags, model_name
from toolkit.native.library import NativeLib, resolve
from toolkit.native.ops import PackedWeight, fixed_schedule, matmul_invariant
from toolkit.paths import cache_root

LOOPS = ("tiles", "pairs", "quads")  # csrc/matmul_invariant.c's MM_TILES, MM_PAIRS, MM_QUADS, in order
# the loops with the software prefetch, then without it (MM_LOOPS + each): csrc/matmul_invariant.c's schedules
SCHEDULES = (*LOOPS, *(f"{name}-nopf" for name in LOOPS))
SETTINGS = ("auto", "fixed", *SCHEDULES)
# the classes of rows measured: (first, last, the rows timed); more rows than the last class's run tiles
ROW_CLASSES = ((1, 1, 1), (2, 4, 3), (5, 16, 10))
FIXED = tuple(SCHEDULES[fixed_schedule(rows)] for _, _, rows in ROW_CLASSES)  # pairs, tiles, tiles
MEASURED_BYTES = 192 << 20  # the layers' weights timed per pass at most (beyond any L3 the weights stream from)
ROUNDS = 3


@dataclass(frozen=True)
class MatmulSchedule:
    """The schedule of each class of rows (ROW_CLASSES) and how it was chosen."""

    choice: tuple[str, ...] = FIXED
    how: str = "fixed"
    measured_ms: dict[str, dict[str, float]] | None = None  # class -> schedule -> the fastest round's ms

    def for_rows(self, rows: int) -> int:
        """The schedule (its index in SCHEDULES) a matmul of `rows` rows runs."""
        for (first, last, _), name in zip(ROW_CLASSES, self.choice):
            if first <= rows <= last:
                return SCHEDULES.index(name)
        return 0

    def describe(self) -> str:
        classes = ", ".join(
            f"{first if first == last else f'{first}-{last}'}: {name}"
            for (first, last, _), name in zip(ROW_CLASSES, self.choice)
        )
        return f"rows {classes}, {ROW_CLASSES[-1][1] + 1}+: tiles ({self.how})"


def choose(
    setting: str,
    layers: list[PackedWeight],
    head: PackedWeight | None = None,
    lib: NativeLib | None = None,
    batch_invariant: bool = False,
) -> MatmulSchedule:
    """The schedule for a model's packed weights (`layers`: its projections in order, `head`: the LM head's) under
    `setting` (one of SETTINGS)."""
    if setting not in SETTINGS:
        raise ValueError(f"engine.matmul_schedule must be one of {SETTINGS}, got {setting!r}")
    if setting in SCHEDULES:
        return MatmulSchedule((setting,) * len(ROW_CLASSES), f"engine.matmul_schedule={setting}")
    if setting == "fixed" or batch_invariant:
        return MatmulSchedule(FIXED, "fixed: batch_invariant=true" if batch_invariant else "fixed")
    lib = resolve(lib)
    timed = _timed_weights(layers, head)
    path = cache_root() / "kernels" / f"schedule-{_key(lib, timed)}.json"
    try:
        kept = json.loads(path.read_text())
        return MatmulSchedule(tuple(kept["choice"]), f"measured at first use, kept in {path.name}", kept["ms"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ms = measure(timed, lib)
    choice = tuple(min(SCHEDULES, key=lambda s, c=c: (ms[c][s], s != fixed)) for c, fixed in zip(ms, FIXED))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"choice": choice, "ms": ms, "threads": torch.get_num_threads()}))
        os.replace(tmp, path)  # whole or not at all: processes choosing at once each write a complete file
    except OSError as exc:  # a cache it cannot write (read-only, full): the choice holds for this process
        return MatmulSchedule(choice, f"measured at first use, not kept ({exc.strerror or exc})", ms)
    return MatmulSchedule(choice, "measured at first use", ms)


def measure(weights: list[PackedWeight], lib: NativeLib | None = None, rounds: int = ROUNDS) -> dict[str, dict]:
    """ms of one pass over `weights` per class of rows and schedule: the fastest of `rounds` rounds, the schedules
    interleaved in each (a drift of the machine falls on all)."""
    lib = resolve(lib)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for first, last, rows in ROW_CLASSES:
        xs = {k: torch.randn(rows, k, generator=gen) for k in {w.k for w in weights}}
        best = dict.fromkeys(SCHEDULES, float("inf"))
        for r in range(rounds):
            for s in SCHEDULES[r % len(SCHEDULES) :] + SCHEDULES[: r % len(SCHEDULES)]:
                t = time.perf_counter()
                for w in weights:
                    matmul_invariant(xs[w.k], w, lib, SCHEDULES.index(s))
                best[s] = min(best[s], 1e3 * (time.perf_counter() - t))
        out[f"{first}-{last}"] = {s: round(v, 3) for s, v in best.items()}
    return out


def _timed_weights(layers: list[PackedWeight], head: PackedWeight | None) -> list[PackedWeight]:
    """The layers' weights from the first, up to MEASURED_BYTES, and the head."""
    timed, total = [], 0
    for w in layers:
        if total >= MEASURED_BYTES:
            break
        timed.append(w)
        total += w.data.numel() * w.data.element_size()
    return timed + ([head] if head is not None else [])


def _key(lib: NativeLib, weights: list[PackedWeight]) -> str:
    """What the fastest schedule depends on: the CPU (its model name and flags), the build's library, the threads,
    the weights' format and shapes."""
    shapes = [(w.k, w.n, str(w.data.dtype)) for w in weights]
    text = json.dumps([model_name(), sorted(cpu_flags()), lib.path.name, torch.get_num_threads(), shapes])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
