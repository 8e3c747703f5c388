"""What this CPU runs: its architecture, its flags and the newest kernel target it executes (a leaf module)."""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

# target -> (architecture it runs on, its -march flags); levels of one architecture from oldest to newest
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "x86-64": ("x86_64", ("-march=x86-64",)),  # SSE2: 4 lanes, no FMA
    "x86-64-v2": ("x86_64", ("-march=x86-64-v2",)),  # SSE4.2: 4 lanes, no FMA
    "x86-64-v3": ("x86_64", ("-march=x86-64-v3",)),  # AVX2 + FMA: 8 lanes
    "x86-64-v4": ("x86_64", ("-march=x86-64-v4",)),  # AVX-512: 16 lanes
    "armv8-a": ("aarch64", ("-march=armv8-a",)),  # NEON: 4 lanes, FMA
    "generic": ("any", ()),  # the compiler's default for its architecture
    "scalar": ("any", ("-DTOOLKIT_VL=1",)),  # plain C: one lane, no FMA
}
# the CPU flags (/proc/cpuinfo) each x86-64 level needs, as the psABI defines the levels
X86_LEVELS = (
    ("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    ("x86-64-v3", {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}),
    ("x86-64-v2", {"sse4_2", "ssse3", "popcnt", "cx16"}),
    ("x86-64", set()),
)


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


@lru_cache(maxsize=1)
def model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (e.g. "AMD EPYC"), or "unknown CPU"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def host_target() -> str:
    """The newest target this CPU executes (read once: native() asks on every kernel call)."""
    arch = machine()
    if arch == "x86_64":
        flags = cpu_flags()
        if not flags:
            return "x86-64"
        return next(name for name, need in X86_LEVELS if need <= flags)
    if arch == "aarch64":
        return "armv8-a"
    return "generic"


def runnable_targets() -> list[str]:
    """Every target this CPU executes (its level and the older ones, `generic`, `scalar`)."""
    host = host_target()
    levels = [name for name, (arch, _) in TARGETS.items() if arch == machine()]
    return levels[: levels.index(host) + 1] + ["generic", "scalar"] if host in levels else ["generic", "scalar"]
