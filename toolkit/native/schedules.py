"""Which loops the packed matmul runs for a step's rows (csrc/matmul_invariant.c's schedules), chosen per class of
rows by a short measurement at first use, and kept per CPU and kernel build.

Every schedule gives the same bits (each output one FMA chain over k in order; tests/test_schedules.py holds them
to it), so the choice is speed alone: how the weights stream. Which is fastest depends on the CPU (its memory,
its prefetchers, its vector width), the rows and the threads, so it is measured, not assumed:

    tiles  panel by panel in blocks of k, row tiles over each block (the general path)
    pairs  two panels at a time, the whole of k in one pass, rows two at a time
    quads  four panels at a time, the whole of k in one pass, a row at a time
    hexes  six panels at a time, the whole of k in one pass, a row at a time (AVX2's 12 chains: 16-bit weights
           give a k step half fp32's bytes, so a row wants more in flight; on an AMD EPYC (avx2), 2 cores, auto
           took it for 2-4 rows of bf16, and at one row it streamed each SmolLM2 weight 5-25% faster than quads)

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
    tiles | pairs | quads | hexes   that one for every class (a benchmark's deliberately wrong choice)

    auto:<target>  measured as auto, over that build's matmul alone (a benchmark's deliberately narrow choice)

**Which build's matmul.** Every FMA build's matmul is the same FMA chain per output (tests/test_matmul_builds.py), so on
an AVX-512 CPU `auto` also times the AVX2 build's (x86-64-v3) schedules on weights packed for its panels, and a
class of rows may run it: the engine's other kernels stay its own build's, and no bit changes. On the Sapphire
Rapids Xeon issue 60 measured, the AVX2 build streamed a decode row's weights faster (22.5 against 18.5 GB/s) and
the AVX-512 build a batch's. Another build runs a class of rows only where it beats the own build's fastest schedule
by OTHER_BUILD_MARGIN, in the survey and again in a duel of the two (medians of DUEL_ROUNDS alternating rounds),
and its second packing is made only for a build some class chose, and only for a model whose
packed weights take at most OTHER_BUILD_BYTES (it doubles their memory).

The run's manifest records the choice and how it was made (`matmul_schedule`).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from toolkit.native.cpu import TARGETS, cpu_flags, model_name
from toolkit.native.library import KernelUnavailable, NativeLib, build_named, resolve
from toolkit.native.ops import PackedWeight, fixed_schedule, matmul_invariant
from toolkit.paths import cache_root

LOOPS = ("tiles", "pairs", "quads", "hexes")  # csrc/matmul_invariant.c's MM_TILES, MM_PAIRS, MM_QUADS, MM_HEXES
# the loops with the software prefetch, then without it (MM_LOOPS + each): csrc/matmul_invariant.c's schedules
SCHEDULES = (*LOOPS, *(f"{name}-nopf" for name in LOOPS))
SETTINGS = ("auto", "fixed", *SCHEDULES)  # and auto:<target> (BUILD_SETTINGS)
BUILD_SETTINGS = tuple(f"auto:{target}" for target in TARGETS)
# the narrower builds whose matmul a build's engine may run in its own's stead (both FMA: the same bits)
NARROWER = {"x86-64-v4": ("x86-64-v3",)}
OTHER_BUILD_BYTES = 2 << 30  # a model's packed weights past this are not packed a second time for another build
OTHER_BUILD_MARGIN = 0.05  # another build's matmul runs a class of rows only where it is this much faster
DUEL_ROUNDS = 9  # the rounds of the duel that confirms another build's pick (medians compared)
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
    measured_ms: dict[str, dict[str, float]] | None = None  # class -> [build ]schedule -> the fastest round's ms
    builds: tuple[str, ...] = ()  # per class, the build whose matmul runs ("" or none: the engine's own)

    def for_rows(self, rows: int) -> int:
        """The schedule (its index in SCHEDULES) a matmul of `rows` rows runs."""
        for (first, last, _), name in zip(ROW_CLASSES, self.choice):
            if first <= rows <= last:
                return SCHEDULES.index(name)
        return 0

    def build_for_rows(self, rows: int) -> str:
        """The build whose matmul `rows` rows run: a target's name, or "" for the engine's own."""
        for (first, last, _), target in zip(ROW_CLASSES, self.builds):
            if first <= rows <= last:
                return target
        return ""

    def lib_for_rows(self, rows: int) -> NativeLib | None:
        """That build's library (None: the engine's own)."""
        target = self.build_for_rows(rows)
        return build_named(target) if target else None

    def other_builds(self) -> list[str]:
        return sorted({b for b in self.builds if b})

    def describe(self) -> str:
        builds = self.builds or ("",) * len(self.choice)
        classes = ", ".join(
            f"{first if first == last else f'{first}-{last}'}: {name}{f' ({target})' if target else ''}"
            for (first, last, _), name, target in zip(ROW_CLASSES, self.choice, builds)
        )
        return f"rows {classes}, {ROW_CLASSES[-1][1] + 1}+: tiles ({self.how})"


def matmul_builds(lib: NativeLib) -> list[NativeLib]:
    """The builds whose matmul `lib`'s engine may run, its own first: every narrower FMA build this CPU runs and
    compiles (NARROWER). A build forced to other lanes (x86-64-v3/4) or without FMA keeps its own."""
    found = [lib]
    if not lib.profile.fma:
        return found
    for target in NARROWER.get(lib.profile.target, ()):
        try:
            other = build_named(target)
        except KernelUnavailable:  # not compiled here: the engine's own build's matmul runs, as before
            continue
        if other.profile.fma:
            found.append(other)
    return found


Packer = Callable[[NativeLib], tuple[list[PackedWeight], PackedWeight | None]]  # a model's weights for a build


def choose(
    setting: str,
    layers: list[PackedWeight],
    head: PackedWeight | None = None,
    lib: NativeLib | None = None,
    batch_invariant: bool = False,
    packed_for: Packer | None = None,
) -> MatmulSchedule:
    """The schedule for a model's packed weights (`layers`: its projections in order, `head`: the LM head's) under
    `setting` (one of SETTINGS, or auto:<target>). `packed_for(build)`: the same weights packed for another build,
    whose matmul `auto` then times too (matmul_builds); without it, the engine's own build's alone."""
    by_build = setting.startswith("auto:") and setting.removeprefix("auto:").partition("/")[0] in TARGETS
    if setting not in SETTINGS and not by_build:
        raise ValueError(f"engine.matmul_schedule must be one of {SETTINGS} or auto:<target>, got {setting!r}")
    if setting in SCHEDULES:
        return MatmulSchedule((setting,) * len(ROW_CLASSES), f"engine.matmul_schedule={setting}")
    if setting == "fixed" or batch_invariant:
        return MatmulSchedule(FIXED, "fixed: batch_invariant=true" if batch_invariant else "fixed")
    lib = resolve(lib)
    size = sum(w.data.numel() * w.data.element_size() for w in [*layers, *([head] if head is not None else [])])
    builds = matmul_builds(lib) if packed_for is not None and size <= OTHER_BUILD_BYTES else [lib]
    if by_build:
        only = setting.removeprefix("auto:")
        builds = [b for b in builds if b.profile.target == only]
        if not builds:
            runnable = ", ".join(b.profile.target for b in matmul_builds(lib))
            raise ValueError(f"engine.matmul_schedule={setting}: this engine's matmul runs in {runnable}, not {only}")
    own = _timed_weights(layers, head)  # another build's packing has the same shapes: the key is theirs
    path = cache_root() / "kernels" / f"schedule-{_key(lib, own, [b.path.name for b in builds])}.json"
    try:
        kept = json.loads(path.read_text())
        return _chosen(kept["choice"], f"measured at first use, kept in {path.name}", kept["ms"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    others = {b.profile.target: (b, _timed_weights(*packed_for(b))) for b in builds if b is not lib}
    ms = measure(own if lib in builds else [], lib, others=others)
    choice = [_fastest(ms[c], fixed) for c, fixed in zip(ms, FIXED)]
    confirmed = {}  # class -> the duel's medians, where the survey chose another build over a measured own one
    for i, (c, fixed) in enumerate(zip(ms, FIXED)):
        own_times = {s: t for s, t in ms[c].items() if " " not in s}
        target = choice[i].rpartition(" ")[0]
        if target in others and own_times:
            mine = min(own_times, key=lambda s, fixed=fixed: (own_times[s], s != fixed))
            confirmed[c] = duel([(mine, lib, own), (choice[i], *others[target])], ROW_CLASSES[i][2])
            if confirmed[c][choice[i]] > (1 - OTHER_BUILD_MARGIN) * confirmed[c][mine]:
                choice[i] = mine
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        kept = {"choice": choice, "ms": ms, "confirmed": confirmed, "threads": torch.get_num_threads()}
        tmp.write_text(json.dumps(kept))
        os.replace(tmp, path)  # whole or not at all: processes choosing at once each write a complete file
    except OSError as exc:  # a cache it cannot write (read-only, full): the choice holds for this process
        return _chosen(choice, f"measured at first use, not kept ({exc.strerror or exc})", ms)
    return _chosen(choice, "measured at first use", ms)


def duel(runs: list[tuple[str, NativeLib, list[PackedWeight]]], rows: int, rounds: int = DUEL_ROUNDS) -> dict:
    """The median ms of a pass over each run's weights (label, its build, its packing) at `rows` rows, `rounds`
    rounds alternating: the survey's pick of another build confirmed against the own build's fastest before its
    weights are packed a second time (a survey's fastest-of-three follows this machine's drift)."""
    gen = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(rows, k, generator=gen) for _, _, ws in runs for k in {w.k for w in ws}}
    times: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    for r in range(rounds):
        for label, build_lib, ws in runs if r % 2 == 0 else runs[::-1]:
            times[label].append(_pass_ms(xs, ws, build_lib, label))
    return {label: round(statistics.median(t), 3) for label, t in times.items()}


def _pass_ms(xs: dict[int, torch.Tensor], weights: list[PackedWeight], lib: NativeLib, label: str) -> float:
    index = SCHEDULES.index(label.rpartition(" ")[2])
    t = time.perf_counter()
    for w in weights:
        matmul_invariant(xs[w.k], w, lib, index)
    return 1e3 * (time.perf_counter() - t)


def _fastest(ms: dict[str, float], fixed: str) -> str:
    """A class's fastest label (a tie goes to the fixed schedule). Another build's ("<target> <name>") must beat the
    own build's fastest by OTHER_BUILD_MARGIN: it costs a second packing of the weights, and a few percent is this
    measurement's noise."""
    own = {s: t for s, t in ms.items() if " " not in s}
    best = min(ms, key=lambda s: (ms[s], s != fixed, " " in s))
    if " " in best and own and ms[best] > (1 - OTHER_BUILD_MARGIN) * min(own.values()):
        return min(own, key=lambda s: (own[s], s != fixed))
    return best


def _chosen(labels: list[str], how: str, ms: dict[str, dict[str, float]]) -> MatmulSchedule:
    """A MatmulSchedule from measured labels: a schedule's name, or "<target> <name>" for another build's."""
    split = [label.rpartition(" ") for label in labels]
    builds = tuple(target for target, _, _ in split)
    return MatmulSchedule(tuple(name for _, _, name in split), how, ms, builds if any(builds) else ())


def measure(
    weights: list[PackedWeight],
    lib: NativeLib | None = None,
    rounds: int = ROUNDS,
    others: dict[str, tuple[NativeLib, list[PackedWeight]]] | None = None,
) -> dict[str, dict]:
    """ms of one pass over `weights` per class of rows and schedule: the fastest of `rounds` rounds, the schedules
    interleaved in each (a drift of the machine falls on all). `others`: another build's library and the same
    weights packed for it, by the build's name; its schedules are timed in the same rounds, as "<name> <schedule>"
    (with no `weights`, only theirs)."""
    lib = resolve(lib)
    runs = [(s, lib, weights) for s in SCHEDULES] if weights else []
    for target, (other, packed) in (others or {}).items():
        runs += [(f"{target} {s}", other, packed) for s in SCHEDULES]
    gen = torch.Generator().manual_seed(0)
    out = {}
    for first, last, rows in ROW_CLASSES:
        xs = {k: torch.randn(rows, k, generator=gen) for _, _, ws in runs for k in {w.k for w in ws}}
        best = {label: float("inf") for label, _, _ in runs}
        for r in range(rounds):
            for label, build_lib, ws in runs[r % len(runs) :] + runs[: r % len(runs)]:
                best[label] = min(best[label], _pass_ms(xs, ws, build_lib, label))
        out[f"{first}-{last}"] = {label: round(v, 3) for label, v in best.items()}
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


def _key(lib: NativeLib, weights: list[PackedWeight], builds: list[str] | None = None) -> str:
    """What the fastest schedule depends on: the CPU (its model name and flags), the build's library (and the
    other builds' timed beside it), the threads, the weights' format and shapes."""
    shapes = [(w.k, w.n, str(w.data.dtype)) for w in weights]
    text = json.dumps([model_name(), sorted(cpu_flags()), lib.path.name, builds, torch.get_num_threads(), shapes])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
