"""Native CPU kernels: every csrc/*.c compiled into one shared library per build, loaded with ctypes.

A build is a named target (an ISA level: `x86-64`, `x86-64-v2`, `x86-64-v3` (AVX2 + FMA), `x86-64-v4`
(AVX-512), `armv8-a` (NEON), `generic` (the compiler's default), `scalar` (plain C, one lane)), a
compiler, and optionally a lane count. The kernels' source is width-generic (csrc/simd.h): the bits a
kernel gives depend only on the build's profile, its lanes and whether it fuses multiply-adds, never on
the compiler or the CPU beyond that (every build is -ffp-contract=off; fused multiply-adds are explicit).

By default the process uses the best target this CPU runs (`host_target()`), the compiler from $CC,
else cc / gcc / clang; `TOOLKIT_KERNEL_TARGET` names another (e.g. `x86-64-v2`, or `x86-64-v3/4` for 4
lanes). `TOOLKIT_NATIVE=0` switches the native path off: everything takes the torch fallback. A build
that fails (no compiler, a compile error) is remembered for the process, and the first use prints one
warning line on stderr naming the cause and the fix; the engine then runs the torch path and its
manifest says so. Libraries are cached under $TOOLKIT_CACHE/kernels, keyed by the sources, the
compiler's version and the flags.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Protocol, TypeVar

import numpy as np
import torch

from toolkit.paths import cache_root

T = TypeVar("T")


class Patches(Protocol):
    """What the sampler's pass reads of a few per-row logit changes (toolkit.processors.base.Patches is one):
    entry k divides the logit at (rows_S[k], cols_S[k]) by factor_S[k] where it is positive, else multiplies."""

    rows_S: torch.Tensor  # int64, non-decreasing
    cols_S: torch.Tensor  # int64
    factor_S: torch.Tensor

    def apply(self, x_RV: torch.Tensor) -> torch.Tensor: ...

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-std=gnu11",
              "-Wno-psabi")
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
X86_LEVELS = (("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
              ("x86-64-v3", {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}),
              ("x86-64-v2", {"sse4_2", "ssse3", "popcnt", "cx16"}),
              ("x86-64", set()))


class KernelUnavailable(RuntimeError):
    pass


def _machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
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
    machine = _machine()
    if machine == "x86_64":
        flags = _cpu_flags()
        if not flags:
            return "x86-64"
        return next(name for name, need in X86_LEVELS if need <= flags)
    if machine == "aarch64":
        return "armv8-a"
    return "generic"


def runnable_targets() -> list[str]:
    """Every target this CPU executes (its level and the older ones, `generic`, `scalar`)."""
    host = host_target()
    levels = [name for name, (arch, _) in TARGETS.items() if arch == _machine()]
    return levels[: levels.index(host) + 1] + ["generic", "scalar"] if host in levels else ["generic", "scalar"]


def compilers() -> list[str]:
    """The C compilers on PATH among gcc and clang."""
    return [cc for cc in ("gcc", "clang") if shutil.which(cc)]


@dataclass(frozen=True)
class Profile:
    """What a build's bits depend on (lanes, fma) and how it runs."""

    target: str
    lanes: int
    fma: bool
    openmp: bool
    compiler: str

    def describe(self) -> str:
        return (f"{self.target} ({self.lanes} lanes, {'FMA' if self.fma else 'no FMA'}, "
                f"{'OpenMP' if self.openmp else 'one thread'}, {self.compiler})")

    @property
    def numerics(self) -> str:
        """The part of the profile a kernel's bits depend on."""
        return f"{self.lanes} lanes, {'fma' if self.fma else 'no fma'}"


P, I64 = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {  # symbol -> argument types (every one returns int)
    "toolkit_paged_attention_f32": [P, I64, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, ctypes.c_float,
                                    ctypes.c_int],
    "toolkit_paged_attention_q8": [P, I64, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, ctypes.c_float,
                                   ctypes.c_int, P, P, I64, P],
    "toolkit_paged_attention_supports": [I64, I64, I64, I64, ctypes.c_int],
    "toolkit_rope_f32": [P, I64, P, P, P, I64, P, I64, I64, I64, ctypes.c_int],
    "toolkit_add_rms_norm_f32": [P, I64, P, I64, P, ctypes.c_float, P, I64, I64, I64, ctypes.c_int],
    "toolkit_silu_mul_f32": [P, I64, P, I64, I64, I64, ctypes.c_int],
    "toolkit_logsumexp_f32": [P, I64, I64, I64, P, ctypes.c_int],
    "toolkit_argmax_f32": [P, I64, I64, I64, P, ctypes.c_int],
    "toolkit_sha256_rows": [P, P, I64, I64, P, ctypes.c_int],
    "toolkit_sha256_rows_ni": [P, P, I64, I64, P, ctypes.c_int],
    "toolkit_sha256_ni_available": [],
    "toolkit_sha256_job": [P, P, I64, I64, P, ctypes.c_int, ctypes.c_int, I64, P, P],
    "toolkit_sha256_job_group_bytes": [],
    "toolkit_matmul_invariant_f32": [P, I64, P, P, I64, I64, I64, I64, ctypes.c_int],
    "toolkit_matmul_invariant_h16": [P, I64, P, P, I64, I64, I64, I64, ctypes.c_int, ctypes.c_int],
    "toolkit_paged_attention_h16": [P, I64, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, ctypes.c_float,
                                    ctypes.c_int, ctypes.c_int],
    "toolkit_round_h16": [P, I64, ctypes.c_int, ctypes.c_int],
    "toolkit_gumbel_sample_rows": [P, I64, I64, I64, P, P, P, P, P, ctypes.c_int],
    "toolkit_gumbel_noise": [P, I64, ctypes.c_uint32, ctypes.c_uint32, P],
    "toolkit_truncate_f32": [P, I64, I64, I64, ctypes.c_int, P, P, I64, P, ctypes.c_int],
    "toolkit_sample_tail_rows": [P, I64, I64, I64, P, P, P, P, P, P, P, P, I64, P, P, P, P, P, P, P, I64, ctypes.c_int],
    "toolkit_decoder_layers": [P, I64, P, P, P, P, P, P, P, P, P, P, ctypes.c_float, ctypes.c_float, ctypes.c_int,
                               ctypes.c_int],
}


class NativeLib:
    """One compiled build of every kernel: its functions by short name (`lib.fn["argmax"]`) and its profile."""

    def __init__(self, path: Path, target: str, compiler: str):
        self.path = path
        dll = ctypes.CDLL(str(path))
        self.fn = {}
        for symbol, argtypes in SIGNATURES.items():
            f = getattr(dll, symbol)
            f.argtypes, f.restype = argtypes, ctypes.c_int
            self.fn[symbol.removeprefix("toolkit_").removesuffix("_f32")] = f
        info = (ctypes.c_int64 * 4)()
        dll.toolkit_kernel_profile(info)
        self.profile = Profile(target, int(info[0]), bool(info[1]), bool(info[3]), compiler)
        layout = (ctypes.c_int64 * 2)()
        dll.toolkit_matmul_layout(layout)
        self.panel, self.lanes = int(layout[0]), int(layout[1])  # the packing its matmul reads
        self.sha_ni = bool(self.fn["sha256_ni_available"]())  # this CPU has the x86 SHA extensions (sha256_rows)
        self.sha_costs: tuple[float, float] | None = None  # measured on first use: see _sha_costs
        self.sha_group_bytes = int(self.fn["sha256_job_group_bytes"]())  # a ShaJob's record of a group of rows

    def attention_supports(self, heads: int, kv_heads: int, head_dim: int, block_size: int, quantized: bool) -> bool:
        return bool(self.fn["paged_attention_supports"](heads, kv_heads, head_dim, block_size, int(quantized)))

    def __repr__(self) -> str:
        return f"NativeLib({self.profile.describe()})"


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _first_error(stderr: str) -> str:
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    errors = [l for l in lines if "error" in l.lower()] or lines or ["(no output)"]
    return errors[0][:200]


def _compile_library(cc: str, flags: list[str], sources: list[Path], target: Path) -> str | None:
    """Compile the sources (in parallel, one process each) and link them into `target`; None, or the
    first error line."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in sources]
        procs = [subprocess.Popen([cc, *flags, "-c", str(src), "-o", str(obj)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for src, obj in zip(sources, objects)]
        errors = [(p.communicate()[1], p.returncode) for p in procs]
        failed = [err for err, rc in errors if rc != 0]
        if failed:
            return _first_error(failed[0])
        out = Path(tmp) / "lib.so"
        link = _run([cc, *flags, "-shared", *map(str, objects), "-o", str(out), "-lm"])
        if link.returncode != 0:
            return _first_error(link.stderr)
        os.replace(out, target)
    return None


def _compiler_name(version: str, cc: str) -> str:
    """'gcc 12.2.0' / 'clang 14.0.6' from `cc --version`'s first line."""
    first = version.splitlines()[0] if version.strip() else Path(cc).name
    words = first.replace("(", " ").replace(")", " ").split()
    if "clang" in first and "version" in words:
        return f"clang {words[words.index('version') + 1]}"
    gcc = "Free Software Foundation" in version or "gcc" in first.lower()
    return f"{'gcc' if gcc else Path(cc).name} {words[-1] if words else ''}".strip()


@lru_cache(maxsize=None)
def _build(target: str, lanes: int | None, cc: str | None, load: bool = True) -> NativeLib | Path | KernelUnavailable:
    """Compile (or find in the cache) and load one build (with load=False only compile it: a target this
    CPU cannot run); a failure is returned, and so remembered for the process."""
    if target not in TARGETS:
        return KernelUnavailable(f"unknown kernel target {target!r} (one of {', '.join(TARGETS)})")
    if load and target not in runnable_targets():
        return KernelUnavailable(f"this CPU ({host_target()}) cannot run kernels built for {target}")
    cc = cc or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return KernelUnavailable("no C compiler found")
    try:
        version = _run([cc, "--version"]).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return KernelUnavailable(f"cannot run the C compiler {cc}: {exc}")
    sources = sorted(CSRC.glob("*.c"))
    text = b"".join(p.read_bytes() for p in [*sources, *sorted(CSRC.glob("*.h"))])
    flags = [*BASE_FLAGS, *TARGETS[target][1], *([f"-DTOOLKIT_VL={lanes}"] if lanes else [])]
    name = target + (f"/{lanes}" if lanes else "")  # as TOOLKIT_KERNEL_TARGET names it
    root = cache_root() / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    errors = []
    for openmp in (["-fopenmp"], []):  # without OpenMP (e.g. Apple's clang) the kernels run on one thread
        key = hashlib.sha256(text + version.encode() + " ".join(flags + openmp).encode()).hexdigest()[:16]
        path = root / f"{name.replace('/', '-')}-{key}.so"
        error = None if path.exists() else _compile_library(cc, flags + openmp, sources, path)
        if error is None and not load:
            return path
        if error is None:
            try:
                return NativeLib(path, name, _compiler_name(version, cc))
            except (OSError, AttributeError) as exc:
                return KernelUnavailable(f"loading {path.name} failed: {exc}")
        errors.append(error)
    return KernelUnavailable(f"compiling the kernels with {Path(cc).name} for {name} failed: {errors[0]}")


def build(target: str | None = None, lanes: int | None = None, cc: str | None = None) -> NativeLib:
    """One build of the kernels (default: this CPU's target, $CC), compiled at most once per process."""
    result = _build(target or host_target(), lanes, cc)
    if isinstance(result, KernelUnavailable):
        raise KernelUnavailable(str(result))
    return result


def compile_only(target: str, lanes: int | None = None, cc: str | None = None) -> Path:
    """Compile a build without loading it (any target, also one this CPU cannot run): its library's path."""
    result = _build(target, lanes, cc, load=False)
    if isinstance(result, KernelUnavailable):
        raise KernelUnavailable(str(result))
    return result


def _default_spec() -> tuple[str, int | None]:
    spec = os.environ.get("TOOLKIT_KERNEL_TARGET") or host_target()
    target, _, lanes = spec.partition("/")
    return target, int(lanes) if lanes.isdigit() else None


@lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def switched_off() -> bool:
    """Whether TOOLKIT_NATIVE (0, false, off or no) switches the native path off in this process."""
    return os.environ.get("TOOLKIT_NATIVE", "1").strip().lower() in ("0", "false", "off", "no")


def native() -> NativeLib:
    """The process's build of the kernels (raises KernelUnavailable). The first failure of a build prints
    one warning line on stderr; with TOOLKIT_NATIVE=0 nothing is compiled and nothing is printed."""
    if switched_off():
        raise KernelUnavailable("native kernels are switched off (TOOLKIT_NATIVE=0; unset it to use them)")
    target, lanes = _default_spec()
    result = _build(target, lanes, os.environ.get("CC") or None)
    if isinstance(result, KernelUnavailable):
        _warn_once(f"toolkit: warning: native CPU kernels unavailable ({result}); running the torch fallback "
                   f"(slower; its logits differ in the last bits). Fix: install gcc or clang (apt-get install "
                   f"gcc) or point CC at one; TOOLKIT_NATIVE=0 picks the fallback without this warning")
        raise KernelUnavailable(f"{result} (fix: install gcc or clang, or point CC at one)")
    return result


def available() -> bool:
    """Whether the process's native kernels run here (built, and not switched off)."""
    return _lib_or_none(None) is not None


def describe_native() -> str:
    """The process's kernel build, or why there is none (for the manifest)."""
    try:
        return native().profile.describe()
    except KernelUnavailable as exc:
        return f"unavailable: {exc}"


OMP_PAUSE_SOFT = 1


@lru_cache(maxsize=1)
def _gnu_openmp_pause() -> Callable[[int], int] | None:
    """omp_pause_resource_all of GNU OpenMP (gcc's, and torch's CPU wheels', loaded with torch), which frees the
    calling thread's team only; None where it is not loaded. LLVM's and Intel's pause the whole runtime (every
    thread's workers), which is not safe while the engine thread runs a parallel region, and they have no
    throttled mode to leave: they are not called."""
    if sys.platform != "linux":
        return None
    try:
        runtime = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None  # not loaded in this process (and not loaded by this)
    pause = getattr(runtime, "omp_pause_resource_all", None)
    if pause is not None:
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def release_openmp_threads() -> bool:
    """Give back the OpenMP worker threads this thread's parallel regions started (GNU OpenMP's
    omp_pause_resource_all); whether they were released.

    Call it on a thread that will not run the engine's parallel work again, before another thread does: each
    thread that starts parallel regions keeps its own team of workers, and libgomp counts the idle ones too;
    once the threads it manages outnumber the CPUs it spins only ~100 times at a barrier before sleeping on a
    futex. A server whose main thread loaded the model while another thread steps the engine is in that state on
    2 cores: 78k context switches over 6 requests, its steps ~20% slower (docs/precision.md)."""
    pause = _gnu_openmp_pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


@lru_cache(maxsize=1)
def fp8_decode_table() -> torch.Tensor:
    """float32 value of every e4m3 byte (the kernel decodes fp8 through it)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().contiguous()


def _lib(lib: NativeLib | None) -> NativeLib:
    return lib if lib is not None else native()


# the 16-bit formats the kernels read (simd.h's H16_* kinds): weights and caches widened exactly to fp32 as they
# are loaded, fp32 multiplies and sums, outputs rounded to the caller's format (nearest, ties to even)
H16_KINDS = {torch.bfloat16: 2, torch.float16: 3}
FLOATS = (torch.float32, *H16_KINDS)  # the activation formats the native kernels take


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """x as fp32 (exact from bf16 / fp16): what the kernels compute on."""
    return x if x.dtype == torch.float32 else x.float()


def round_h16(x: torch.Tensor, dtype: torch.dtype, lib: NativeLib | None = None) -> torch.Tensor:
    """fp32 `x` (contiguous) rounded in place to the nearest values of bf16 / fp16, the kernels' rounding
    (tests hold it to torch's .to(dtype))."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("round_h16 rounds a contiguous fp32 tensor in place")
    if _lib(lib).fn["round_h16"](x.data_ptr(), x.numel(), H16_KINDS[dtype], torch.get_num_threads()) != 0:
        raise ValueError(f"no 16-bit format {dtype}")
    return x


def _lib_or_none(lib: NativeLib | None) -> NativeLib | None:
    """The build to use, or None where the native kernels do not run (the caller takes torch's path)."""
    try:
        return _lib(lib)
    except KernelUnavailable:
        return None


def rope_cpu(x_NHD: torch.Tensor, cos_PD: torch.Tensor, sin_PD: torch.Tensor, positions_N: torch.Tensor,
             lib: NativeLib | None = None) -> torch.Tensor:
    """x * cos[pos] + rotate_half(x) * sin[pos] for fp32 heads (N, heads, D) whose rows may be strided
    (a view into the fused q|k|v output); returns a new contiguous tensor. No fused multiply-add: its
    bits are those of torch's `x * cos + rotate_half(x) * sin` in every build."""
    n, h, d = x_NHD.shape
    if x_NHD.dtype != torch.float32:  # bf16 / fp16 heads: computed in fp32, rounded back
        return rope_cpu(x_NHD.float(), cos_PD, sin_PD, positions_N, lib).to(x_NHD.dtype)
    if x_NHD.stride(2) != 1 or x_NHD.stride(1) != d:
        x_NHD = x_NHD.contiguous()
    out = torch.empty((n, h, d), dtype=torch.float32)
    positions_N = positions_N.contiguous()
    rc = _lib(lib).fn["rope"](x_NHD.data_ptr(), x_NHD.stride(0), out.data_ptr(), cos_PD.data_ptr(), sin_PD.data_ptr(),
                              cos_PD.shape[0], positions_N.data_ptr(), n, h, d, torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"a position is outside the rotary table of {cos_PD.shape[0]} positions")
    if rc != 0:
        raise KernelUnavailable(f"rope kernel refused head_dim {d}")
    return out


def _rows_ok(x: torch.Tensor) -> bool:
    """A 2-D fp32 CPU tensor whose rows are contiguous: what the row-wise kernels read in place."""
    return x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1


def logsumexp_cpu(x_RV: torch.Tensor, lib: NativeLib | None = None) -> torch.Tensor | None:
    """logsumexp of each row (R,) in one C pass per row, or None where the kernel does not apply."""
    lib = _lib_or_none(lib) if _rows_ok(x_RV) else None
    if lib is None:
        return None
    out = torch.empty(x_RV.shape[0], dtype=torch.float32)
    lib.fn["logsumexp"](x_RV.data_ptr(), x_RV.stride(0), x_RV.shape[0], x_RV.shape[1], out.data_ptr(),
                              torch.get_num_threads())
    return out


def argmax_cpu(x_RV: torch.Tensor, lib: NativeLib | None = None) -> list[int] | None:
    """torch.argmax(x, dim=-1) of each row (the first maximal index; a NaN counts as the maximum) in one
    C pass, or None where the kernel does not apply."""
    lib = _lib_or_none(lib) if _rows_ok(x_RV) and x_RV.shape[1] > 0 else None
    if lib is None:
        return None
    out = torch.empty(x_RV.shape[0], dtype=torch.int64)
    lib.fn["argmax"](x_RV.data_ptr(), x_RV.stride(0), x_RV.shape[0], x_RV.shape[1], out.data_ptr(),
                           torch.get_num_threads())
    return out.tolist()


def gumbel_sample_cpu(x_RV: torch.Tensor, keys: list[tuple[int, int] | None],
                      lib: NativeLib | None = None) -> tuple[list[int], list[float], list[int]] | None:
    """For each row: the Gumbel-max token over its finite logits under its key (None: not sampled,
    token -1), that token's noise (NaN where none) and the row's count of finite logits, all rows in
    one C call (toolkit/csrc/gumbel.c); None where the kernel does not apply."""
    lib = _lib_or_none(lib) if _rows_ok(x_RV) and x_RV.shape[1] < 2 ** 31 else None
    if lib is None:
        return None
    n = x_RV.shape[0]
    keys_t = torch.tensor([k if k is not None else (0, 0) for k in keys], dtype=torch.int64).to(torch.int32)
    sampled = torch.tensor([k is not None for k in keys], dtype=torch.int8)
    tokens = torch.full((n,), -1, dtype=torch.int64)
    noise = torch.full((n,), float("nan"), dtype=torch.float64)
    support = torch.empty(n, dtype=torch.int64)
    if lib.fn["gumbel_sample_rows"](x_RV.data_ptr(), x_RV.stride(0), x_RV.shape[1], n, keys_t.data_ptr(),
                                    sampled.data_ptr(), tokens.data_ptr(), noise.data_ptr(), support.data_ptr(),
                                    torch.get_num_threads()) != 0:
        raise MemoryError("gumbel_sample_rows: out of memory")
    return tokens.tolist(), noise.tolist(), support.tolist()


TRUNCATION_MODES = {"top_p": 0, "top_k": 1}


def truncate_cpu(x_RV: torch.Tensor, mode: str, param_R: torch.Tensor, lib: NativeLib | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """top-p (param p) or top-k (param k) of every row in one C call: (the rows with the logits below
    each row's threshold set to -inf, the thresholds), found by bisection over the logits' order
    (toolkit/csrc/gumbel.c); None where the kernel does not apply."""
    lib = _lib_or_none(lib) if _rows_ok(x_RV) and x_RV.shape[1] > 0 else None
    if lib is None:
        return None
    param_R = param_R.to(torch.float32).contiguous()
    out = torch.empty(x_RV.shape, dtype=torch.float32)
    thresholds = torch.empty(x_RV.shape[0], dtype=torch.float32)
    if lib.fn["truncate"](x_RV.data_ptr(), x_RV.stride(0), x_RV.shape[0], x_RV.shape[1], TRUNCATION_MODES[mode],
                          param_R.data_ptr(), out.data_ptr(), out.stride(0), thresholds.data_ptr(),
                          torch.get_num_threads()) != 0:
        raise MemoryError("truncate: out of memory")
    return out, thresholds


TAIL_OPS = {"top_p": 0, "top_k": 1, "temperature": 2}  # what toolkit_sample_tail_rows applies, per row, in order
TAIL_WIDTH = 3  # ops per row


def _tail_lib(x_RV: torch.Tensor, lib: NativeLib | None) -> NativeLib | None:
    return _lib_or_none(lib) if _rows_ok(x_RV) and 0 < x_RV.shape[1] < 2 ** 31 else None


def tail_fusable(x_RV: torch.Tensor, lib: NativeLib | None = None) -> bool:
    """Whether `sample_tail_cpu` runs on these logits (fp32 CPU rows and a native build)."""
    return _tail_lib(x_RV, lib) is not None


@dataclass(frozen=True)
class TailSample:
    """What sample_tail_cpu returns: per row, the token (the Gumbel-max token where sampled, else the
    processed row's argmax), its noise (NaN where not sampled), the processed row's support (finite
    logits) and logsumexp, and the processed logit at the token; the processed rows where asked for."""

    tokens: list[int]
    noise: list[float]
    support: list[int]
    logsumexp_R: torch.Tensor
    picked_R: torch.Tensor
    processed_RV: torch.Tensor | None
    kept_bits_RB: torch.Tensor | None = None  # (R, ceil(V / 8)) uint8 kept masks of rows with support < V
    raw_logsumexp_R: torch.Tensor | None = None  # the input rows' logsumexp, where asked for


def sample_tail_cpu(x_RV: torch.Tensor, ops: list[tuple[tuple[str, float], ...]], keys: list[tuple[int, int] | None],
                    keep_rows: bool = True, lib: NativeLib | None = None,
                    patches: Patches | None = None, raw_logsumexp: bool = False) -> TailSample | None:
    """Each row through its ops ((name, value) in order: temperature, top_k, top_p, as the processors of
    those names compute them), then its support, logsumexp, and Gumbel-max token and noise under its key
    (None: not sampled, the argmax instead), in one C call that keeps each row in cache
    (toolkit/csrc/gumbel.c): the same bits as `truncate_cpu`, `logsumexp_cpu`, `gumbel_sample_cpu` and
    `argmax_cpu` one after another. `keep_rows=False` never writes the processed rows out (a write of the
    whole block saved); `patches` are made to each row before its ops (`patches.apply(x_RV)` as the
    input, without copying the block); `raw_logsumexp` also returns the input rows' logsumexp (logsumexp_cpu's
    bits), read while each row is in cache; None where the kernel does not apply."""
    call = TailCall.of(x_RV, ops, keys, keep_rows, lib, patches, raw_logsumexp)
    return call.result() if call is not None else None


class TailCall:
    """sample_tail_cpu in its three parts, so that a caller can put its Python beside other work: the
    arguments checked and laid out (`of`), the kernel's pass on every thread (`run`), and its TailSample
    (`result`). The input rows and patches must not change until the pass has run."""

    def __init__(self, lib: NativeLib, x_RV: torch.Tensor, ops: list[tuple[tuple[str, float], ...]],
                 keys: list[tuple[int, int] | None], keep_rows: bool, patches: Patches | None, raw_logsumexp: bool):
        n, vocab = x_RV.shape
        # the rows' ops, encoded once per distinct tuple (a step's rows mostly share their parameters); the
        # small arrays in numpy (a torch.tensor of nested lists took ~10 us each, several times that cold)
        distinct: dict = {}
        which = [distinct.setdefault(row, len(distinct)) for row in ops]
        if any(len(row) > TAIL_WIDTH for row in distinct):
            raise ValueError(f"at most {TAIL_WIDTH} tail ops a row")
        pad = ((-1, 0.0),) * TAIL_WIDTH
        table = [[(TAIL_OPS[name], value) for name, value in row] + list(pad[len(row):]) for row in distinct]
        codes = np.array([[code for code, _ in row] for row in table], np.int32)[which]
        values = np.array([[value for _, value in row] for row in table], np.float32)[which]
        keys_w = np.array([k if k is not None else (0, 0) for k in keys], np.uint32).reshape(n, 2)
        sampled = np.array([k is not None for k in keys], np.int8)
        self.out = torch.empty((n, vocab), dtype=torch.float32) if keep_rows else None
        self.lse, self.picked = np.empty(n, np.float32), np.empty(n, np.float32)
        self.raw_lse = np.empty(n, np.float32) if raw_logsumexp else None
        self.tokens, self.noise, self.support = np.empty(n, np.int64), np.empty(n, np.float64), np.empty(n, np.int64)
        self.kept = np.empty((n, (vocab + 7) // 8), np.uint8)  # filled only for rows with support < V
        patch = (None, None, None)
        if patches is not None and patches.rows_S.numel():
            # checked, host-side in numpy (a few hundred entries): the kernel writes where they say
            rows_S, cols_S = patches.rows_S.numpy(), patches.cols_S.numpy()
            if (rows_S[0] < 0 or rows_S[-1] >= n or (rows_S[1:] < rows_S[:-1]).any()
                    or cols_S.min() < 0 or cols_S.max() >= vocab):
                raise ValueError(f"patches must list rows in order within [0, {n}) and columns within [0, {vocab})")
            off = np.zeros(n + 1, np.int64)
            np.cumsum(np.bincount(rows_S, minlength=n), out=off[1:])
            patch = (off, cols_S.astype(np.int32), np.ascontiguousarray(patches.factor_S.to(torch.float32).numpy()))
        self._keep = (x_RV, codes, values, keys_w, sampled, patch)  # alive until the call returns
        self._args = (x_RV.data_ptr(), x_RV.stride(0), n, vocab, codes.ctypes.data, values.ctypes.data,
                      *(a.ctypes.data if a is not None else None for a in patch), keys_w.ctypes.data,
                      sampled.ctypes.data, self.out.data_ptr() if keep_rows else None, vocab,
                      self.raw_lse.ctypes.data if raw_logsumexp else None, self.lse.ctypes.data,
                      self.tokens.ctypes.data, self.noise.ctypes.data, self.support.ctypes.data,
                      self.picked.ctypes.data, self.kept.ctypes.data, self.kept.shape[1], torch.get_num_threads())
        self._fn = lib.fn["sample_tail_rows"]
        self.done = False

    @classmethod
    def of(cls, x_RV: torch.Tensor, ops: list[tuple[tuple[str, float], ...]], keys: list[tuple[int, int] | None],
           keep_rows: bool = True, lib: NativeLib | None = None, patches: Patches | None = None,
           raw_logsumexp: bool = False) -> "TailCall | None":
        """sample_tail_cpu's call for these arguments (see there), not yet run; None where the kernel does not
        apply."""
        lib = _tail_lib(x_RV, lib)
        return cls(lib, x_RV, ops, keys, keep_rows, patches, raw_logsumexp) if lib is not None else None

    def run(self) -> None:
        """The kernel's pass (once)."""
        if not self.done:
            if self._fn(*self._args) != 0:
                raise MemoryError("sample_tail_rows: out of memory")
            self.done = True

    def result(self) -> TailSample:
        self.run()
        return TailSample(self.tokens.tolist(), self.noise.tolist(), self.support.tolist(), torch.from_numpy(self.lse),
                          torch.from_numpy(self.picked), self.out, torch.from_numpy(self.kept),
                          torch.from_numpy(self.raw_lse) if self.raw_lse is not None else None)


def gumbel_noise_cpu(ids: torch.Tensor, key: tuple[int, int], lib: NativeLib | None = None) -> torch.Tensor:
    """The kernel's noise (float64) for token ids under one key: what the twins in rng.py must equal."""
    ids = ids.to(torch.int32).contiguous()
    out = torch.empty(ids.shape[0], dtype=torch.float64)
    _lib(lib).fn["gumbel_noise"](ids.data_ptr(), ids.shape[0], key[0], key[1], out.data_ptr())
    return out


def add_rms_norm_cpu(x_ND: torch.Tensor, residual_ND: torch.Tensor | None, weight_D: torch.Tensor,
                     eps: float, lib: NativeLib | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm(x + residual) * weight) for fp32 rows in one pass; `x` is updated in place
    (it must be a tensor the caller owns) and returned; without a residual, just the norm. bf16 / fp16 rows
    are computed in fp32 and both outputs rounded back (x then is a new tensor)."""
    if x_ND.dtype != torch.float32:
        dtype = x_ND.dtype
        x32, h32 = add_rms_norm_cpu(x_ND.float(), None if residual_ND is None else _fp32(residual_ND),
                                    _fp32(weight_D), eps, lib)
        return x32.to(dtype), h32.to(dtype)
    n, d = x_ND.shape
    if x_ND.stride(1) != 1:
        x_ND = x_ND.contiguous()
    if residual_ND is not None and residual_ND.stride(1) != 1:
        residual_ND = residual_ND.contiguous()
    h = torch.empty((n, d), dtype=torch.float32)
    r_ptr, r_stride = (residual_ND.data_ptr(), residual_ND.stride(0)) if residual_ND is not None else (None, 0)
    _lib(lib).fn["add_rms_norm"](x_ND.data_ptr(), x_ND.stride(0), r_ptr, r_stride, weight_D.data_ptr(), eps,
                                 h.data_ptr(), d, n, d, torch.get_num_threads())
    return x_ND, h


def silu_mul_cpu(gate_up_N2F: torch.Tensor, lib: NativeLib | None = None) -> torch.Tensor:
    """silu(gate) * up from fp32 rows [gate | up] (a fused projection's output), in one pass; bf16 / fp16
    rows in fp32, rounded back."""
    if gate_up_N2F.dtype != torch.float32:
        return silu_mul_cpu(gate_up_N2F.float(), lib).to(gate_up_N2F.dtype)
    n, f2 = gate_up_N2F.shape
    if gate_up_N2F.stride(1) != 1:
        gate_up_N2F = gate_up_N2F.contiguous()
    f = f2 // 2
    h = torch.empty((n, f), dtype=torch.float32)
    _lib(lib).fn["silu_mul"](gate_up_N2F.data_ptr(), gate_up_N2F.stride(0), h.data_ptr(), f, n, f,
                             torch.get_num_threads())
    return h


SHA_METHODS = ("auto", "lanes", "sha_ni")


def sha256_rows(rows_RB, index: "list[int] | None" = None, threads: int | None = None,
                lib: NativeLib | None = None, method: str = "auto") -> list[str]:
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
        x.data_ptr(), offsets.ctypes.data, len(index), x.shape[1] * x.element_size(), out.ctypes.data, threads)
    return _hexes(out)


class ShaJob:
    """The sha256 hex digests of rows of a 2-D CPU tensor or numpy array (rows `index`, all by default), hashed
    in parts: `beside(fn)` runs fn on this thread while the other threads hash, as far as they get before fn
    returns (Python's own work on one core, beside hashing that would otherwise leave it alone), and may be
    called several times; `digests()` hashes what is left on every thread and returns what sha256_rows would.
    The rows must not change until then. Where the kernels do not run (or for one or two rows) beside(fn) is
    fn() and digests() hashes every row. An exception from fn is raised after the other threads stop. Calls
    from different threads take turns (a lock): a group of rows is never hashed by two calls at once."""

    def __init__(self, rows_RB, index: "list[int] | None" = None, threads: int | None = None,
                 lib: NativeLib | None = None, method: str = "auto"):
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
        return self._lib.fn["sha256_job"](self._x.data_ptr(), self._offsets.ctypes.data, self._rows,
                                          self._x.shape[1] * self._x.element_size(), self._out.ctypes.data,
                                          self._threads, self._method, self._group_rows, self._state.ctypes.data,
                                          callback)

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
    lib = _lib_or_none(lib) if len(index) > 2 or method != "auto" else None
    if lib is None:
        return [hashlib.sha256(x[i].numpy().view("uint8")).hexdigest() for i in index]
    threads = threads or torch.get_num_threads()
    if method == "sha_ni" and not lib.sha_ni:
        raise KernelUnavailable("this CPU has no SHA extensions (sha256_rows method='sha_ni')")
    if method == "auto":
        method = "sha_ni" if lib.sha_ni and _sha_ni_faster(lib, len(index), threads) else "lanes"
    offsets = (np.arange(len(index), dtype=np.int64) if whole else np.array(index, dtype=np.int64)
               ) * (x.stride(0) * x.element_size())
    return lib, x, index, threads, method, offsets, np.empty((len(index), 32), np.uint8)


def _hexes(out: np.ndarray) -> list[str]:
    hexes = out.tobytes().hex()
    return [hexes[64 * i:64 * i + 64] for i in range(out.shape[0])]


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


@dataclass(frozen=True)
class PackedWeight:
    """A (K, N) fp32, bf16 or fp16 weight laid out panel by panel for the batch-invariant matmul of builds
    whose wide panels are `panel` columns and narrow ones `lanes` (`data` keeps the weight's format)."""

    data: torch.Tensor
    k: int
    n: int
    panel: int
    lanes: int


def pack_weight(w_KN: torch.Tensor, lib: NativeLib | None = None) -> PackedWeight:
    """Column panels of the build's wide panel width, then of its lanes, then the last N % lanes
    columns, each panel contiguous; in a bf16 wide panel each k's blocks of `lanes` columns are interleaved
    in pairs (weight by weight), which the kernel widens two blocks at a time."""
    lib = _lib(lib)
    nr, vl = lib.panel, lib.lanes
    k, n = w_KN.shape
    wide, narrow = n // nr, (n % nr) // vl
    vec_end = wide * nr + narrow * vl
    if w_KN.dtype not in FLOATS:
        raise KernelUnavailable(f"the batch-invariant matmul reads fp32, bf16 or fp16 weights, not {w_KN.dtype}")
    data = torch.empty(k * n, dtype=w_KN.dtype)  # each part copied into place once
    panels = w_KN[:, : wide * nr].reshape(k, wide, nr).permute(1, 0, 2)
    if w_KN.dtype == torch.bfloat16:  # each k's column blocks in interleaved pairs (csrc/matmul_invariant.c)
        panels = panels.reshape(wide, k, nr // (2 * vl), 2, vl).transpose(3, 4)
    data[: k * wide * nr].view(panels.shape).copy_(panels)
    data[k * wide * nr: k * vec_end].view(narrow, k, vl).copy_(
        w_KN[:, wide * nr: vec_end].reshape(k, narrow, vl).permute(1, 0, 2))
    data[k * vec_end:].view(k, n - vec_end).copy_(w_KN[:, vec_end:])
    return PackedWeight(data, k, n, nr, vl)


def matmul_invariant(x_MK: torch.Tensor, w: torch.Tensor | PackedWeight, lib: NativeLib | None = None) -> torch.Tensor:
    """x @ w in fp32 with each output element summed over k in order, by one FMA chain: a row's
    result does not depend on the other rows, on M, or on the number of threads. `w` is (K, N),
    packed with `pack_weight` once (a plain tensor is packed on every call)."""
    lib = _lib(lib)
    packed = w if isinstance(w, PackedWeight) else pack_weight(w, lib)
    if (packed.panel, packed.lanes) != (lib.panel, lib.lanes):
        raise ValueError(f"weight packed for panels of {packed.panel}/{packed.lanes} columns, this build reads "
                         f"{lib.panel}/{lib.lanes}: pack it with this build")
    if x_MK.dtype not in FLOATS or x_MK.device.type != "cpu":
        raise KernelUnavailable("the batch-invariant matmul runs fp32, bf16 or fp16 on the CPU")
    dtype = x_MK.dtype
    x_MK = _fp32(x_MK)
    if x_MK.stride(-1) != 1:
        x_MK = x_MK.contiguous()
    m = x_MK.shape[0]
    out = torch.empty((m, packed.n), dtype=torch.float32)
    args = (x_MK.data_ptr(), x_MK.stride(0), packed.data.data_ptr(), out.data_ptr(), packed.n, m, packed.k, packed.n,
            torch.get_num_threads())
    if packed.data.dtype == torch.float32:
        lib.fn["matmul_invariant"](*args)
    else:
        lib.fn["matmul_invariant_h16"](*args, H16_KINDS[packed.data.dtype])
    return out if dtype == torch.float32 else out.to(dtype)


def paged_attention_cpu(q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables_SB: torch.Tensor, query_table_N: torch.Tensor, query_ctx_N: torch.Tensor,
                        scale: float, out_NHD: torch.Tensor | None = None, lib: NativeLib | None = None) -> torch.Tensor:
    """Attention of N query tokens, each over its own sequence's first query_ctx[n] cached keys. The cache is
    fp32, bf16 or fp16 (read widened); bf16 / fp16 queries are computed in fp32 and the output rounded to
    their format (`out_NHD`, if given, has the queries' format)."""
    n, h, d = q_NHD.shape
    _, bs, k, _ = k_cache.shape
    dtype = q_NHD.dtype
    q_NHD = _fp32(q_NHD)
    if q_NHD.stride(2) != 1 or q_NHD.stride(1) != d:
        q_NHD = q_NHD.contiguous()
    direct = out_NHD is not None and dtype == torch.float32
    out = out_NHD if direct else torch.empty((n, h, d), dtype=torch.float32)
    args = (q_NHD.data_ptr(), q_NHD.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables_SB.data_ptr(),
            block_tables_SB.stride(0), query_table_N.data_ptr(), query_ctx_N.data_ptr(), out.data_ptr(),
            n, h, k, d, bs, float(scale), torch.get_num_threads())
    if k_cache.dtype == torch.float32:
        rc = _lib(lib).fn["paged_attention"](*args)
    else:
        rc = _lib(lib).fn["paged_attention_h16"](*args, H16_KINDS[k_cache.dtype])
    if rc != 0:
        raise KernelUnavailable(f"paged attention kernel refused shapes H={h} K={k} D={d} block_size={bs} "
                                f"over a {k_cache.dtype} cache")
    if direct or dtype == torch.float32:
        return out
    if out_NHD is None:
        return out.to(dtype)
    return out_NHD.copy_(out)


def paged_attention_cpu_q8(q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scales: torch.Tensor, v_scales: torch.Tensor, block_tables_SB: torch.Tensor,
                           query_table_N: torch.Tensor, query_ctx_N: torch.Tensor, scale: float,
                           out_NHD: torch.Tensor, lib: NativeLib | None = None) -> torch.Tensor:
    """paged_attention_cpu over an int8 / fp8 cache with per-(block, KV head) scales ([blocks, K]) or
    static per-tensor ones ([K]); bf16 / fp16 queries in fp32, the output rounded into `out_NHD`."""
    if q_NHD.dtype != torch.float32:
        out32 = paged_attention_cpu_q8(q_NHD.float(), k_cache, v_cache, _fp32(k_scales), _fp32(v_scales),
                                       block_tables_SB, query_table_N, query_ctx_N, scale,
                                       torch.empty(q_NHD.shape, dtype=torch.float32), lib)
        return out_NHD.copy_(out32)
    n, h, d = q_NHD.shape
    _, bs, k, _ = k_cache.shape
    if q_NHD.stride(2) != 1 or q_NHD.stride(1) != d:
        q_NHD = q_NHD.contiguous()
    lut = fp8_decode_table().data_ptr() if k_cache.dtype == torch.float8_e4m3fn else None
    stride = k_scales.stride(0) if k_scales.dim() == 2 else 0
    rc = _lib(lib).fn["paged_attention_q8"](
        q_NHD.data_ptr(), q_NHD.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables_SB.data_ptr(),
        block_tables_SB.stride(0), query_table_N.data_ptr(), query_ctx_N.data_ptr(), out_NHD.data_ptr(), n, h, k, d,
        bs, float(scale), torch.get_num_threads(), k_scales.data_ptr(), v_scales.data_ptr(), stride, lut)
    if rc != 0:
        raise KernelUnavailable(f"quantised paged attention kernel refused shapes H={h} K={k} D={d}")
    return out_NHD


def decoder_layers_cpu(x_NE: torch.Tensor, layers_L8: torch.Tensor, dims: tuple[int, ...], positions_N: torch.Tensor,
                       slots_N: torch.Tensor, cos_PD: torch.Tensor, sin_PD: torch.Tensor, block_tables_SB: torch.Tensor,
                       query_table_N: torch.Tensor, query_ctx_N: torch.Tensor, eps: float, scale: float,
                       num_slots: int, lib: NativeLib | None = None, kind: int = 0) -> None:
    """Run a Llama-style decoder's layers over the step's N tokens in one call (csrc/decoder_layers.c):
    `x` (N, hidden), contiguous, is updated in place to the last layer's residual stream. `layers_L8` holds
    each layer's addresses (ln_attn, ln_mlp, packed w_qkv, w_o, w_gate_up, w_down, K cache, V cache);
    dims = (N, hidden, heads, kv heads, head dim, MLP width, block size); a slot outside the cache's
    `num_slots` raises before anything is written. A bf16 / fp16 model passes x in its format, 16-bit packed
    projections and caches and fp32 norm weights: every operation's outputs are rounded to that format."""
    if x_NE.dtype != torch.float32:
        x32 = x_NE.float()
        decoder_layers_cpu(x32, layers_L8, dims, positions_N, slots_N, cos_PD, sin_PD, block_tables_SB, query_table_N,
                           query_ctx_N, eps, scale, num_slots, lib, kind=H16_KINDS[x_NE.dtype])
        x_NE.copy_(x32)  # exact: rounded already
        return
    n, e, h, k, d, f, bs = dims
    widths = [e, (h + 2 * k) * d, (h + k) * d, h * d, e, 2 * f, f, e]  # h, qkv, qk, attn, o, gate_up, act, m
    work = torch.empty(n * sum(widths), dtype=torch.float32)
    offsets = torch.tensor([0, *widths[:-1]], dtype=torch.int64).cumsum(0) * (n * 4) + work.data_ptr()
    all_dims = torch.tensor([n, e, h, k, d, f, bs, cos_PD.shape[0], block_tables_SB.stride(0), num_slots],
                            dtype=torch.int64)
    rc = _lib(lib).fn["decoder_layers"](
        layers_L8.data_ptr(), layers_L8.shape[0], all_dims.data_ptr(), x_NE.data_ptr(), offsets.data_ptr(),
        positions_N.data_ptr(), slots_N.data_ptr(), cos_PD.data_ptr(), sin_PD.data_ptr(), block_tables_SB.data_ptr(),
        query_table_N.data_ptr(), query_ctx_N.data_ptr(), eps, scale, torch.get_num_threads(), kind)
    if rc == -3:
        raise IndexError(f"a KV slot is outside the cache's {num_slots} slots")
    if rc == -2:
        raise IndexError(f"a position is outside the rotary table of {cos_PD.shape[0]} positions")
    if rc != 0:
        raise KernelUnavailable(f"a native decoder kernel refused the shapes {dims}")
