"""See other CPUs from this one: rerun the numerics-sensitive tests (pytest marker `numerics`) as an older CPU
would run them, so a threshold that holds only for this machine's lane order fails here, not on the next one.

    python .ci/older_cpus.py [pytest args]     (make test runs it after the suite)

Two reruns, each named with its environment on one line before it runs:
  1. the native kernels built for an older target this CPU also executes (TOOLKIT_KERNEL_TARGET): AVX-512 ->
     x86-64-v3 (8 lanes), AVX2 -> x86-64-v2 (4 lanes, no FMA), anything else -> scalar (one lane, no FMA);
  2. the torch fallback (TOOLKIT_NATIVE=0) with torch, oneDNN and MKL held to an older instruction set:
     AVX-512 -> AVX2, AVX2 -> the baseline (SSE), elsewhere torch's `default` kernels.
Exits with the first non-zero pytest status (5, no test selected, counts as a failure when no pytest arguments
narrow the run: the marker went missing).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from toolkit.native.cpu import host_target, runnable_targets  # noqa: E402  (the checkout's, not an installed copy)

OLDER_TARGET = {"x86-64-v4": "x86-64-v3", "x86-64-v3": "x86-64-v2"}
# torch's capability -> what to hold torch (ATEN_CPU_CAPABILITY), oneDNN and MKL to
OLDER_TORCH = {
    "AVX512": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "AVX2": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def older_environments() -> list[tuple[str, dict[str, str]]]:
    """(what it stands for, the variables) for each rerun on this machine."""
    host = host_target()
    target = OLDER_TARGET.get(host, "scalar")
    assert target in runnable_targets(), (host, target)
    capability = torch.backends.cpu.get_cpu_capability()
    held = OLDER_TORCH.get(capability, {"ATEN_CPU_CAPABILITY": "default"})
    return [
        (f"native kernels built for {target} (this CPU: {host})", {"TOOLKIT_KERNEL_TARGET": target}),
        (
            f"torch fallback held to {held['ATEN_CPU_CAPABILITY']} (this CPU: {capability})",
            {"TOOLKIT_NATIVE": "0", **held},
        ),
    ]


def main(args: list[str]) -> int:
    for label, env in older_environments():
        print(f"\n== numerics rerun: {label}: {' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
        status = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "numerics", *args], cwd=ROOT, env={**os.environ, **env}
        ).returncode
        if status == 5 and args:
            print(f"no numerics test among {' '.join(args)}", flush=True)
            continue
        if status != 0:
            print(f"numerics rerun failed ({label}): pytest exited {status}", flush=True)
            return status or 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
