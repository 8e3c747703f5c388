"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

The shared library is cached under $TOOLKIT_CACHE/kernels, keyed by the source, the
compiler and the CPU's flags (it is built with -march=native). When no compiler is
available the caller falls back to the pure-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from toolkit.models.loading import cache_root

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC", "-std=gnu11"]


class KernelUnavailable(RuntimeError):
    pass


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


@lru_cache(maxsize=1)
def load_paged_attention():
    """The compiled `toolkit_paged_attention_f32` function (raises KernelUnavailable)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler found (set CC)")
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"cannot run {cc}: {exc}") from None
    key = hashlib.sha256(source + version.encode() + _cpu_flags().encode() + " ".join(FLAGS).encode()).hexdigest()
    target = cache_root() / "kernels" / f"paged_attention-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
        os.close(fd)
        result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise KernelUnavailable(f"compiling {SOURCE.name} failed: {result.stderr.strip()[:300]}")
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    fn = lib.toolkit_paged_attention_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def paged_attention_cpu(q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables_SB: torch.Tensor, query_table_N: torch.Tensor, query_ctx_N: torch.Tensor,
                        scale: float, out_NHD: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of N query tokens, each over its own sequence's first query_ctx[n] cached keys."""
    n, h, d = q_NHD.shape
    _, bs, k, _ = k_cache.shape
    if q_NHD.stride(2) != 1 or q_NHD.stride(1) != d:
        q_NHD = q_NHD.contiguous()
    out = out_NHD if out_NHD is not None else torch.empty((n, h, d), dtype=torch.float32)
    fn = load_paged_attention()
    rc = fn(q_NHD.data_ptr(), q_NHD.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables_SB.data_ptr(),
            block_tables_SB.stride(0), query_table_N.data_ptr(), query_ctx_N.data_ptr(), out.data_ptr(),
            n, h, k, d, bs, float(scale), torch.get_num_threads())
    if rc != 0:
        raise KernelUnavailable(f"paged attention kernel refused shapes H={h} K={k} D={d} block_size={bs}")
    return out
