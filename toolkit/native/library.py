"""The kernels' shared library: compiled from csrc/ per build (target, compiler, lanes), cached on disk, loaded
with ctypes; the process's build (`native()`), and what to do when there is none (one warning line, the torch path)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

from toolkit.native.cpu import TARGETS, host_target, runnable_targets
from toolkit.paths import cache_root

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-std=gnu11", "-Wno-psabi")


class KernelUnavailable(RuntimeError):
    pass


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
        return (
            f"{self.target} ({self.lanes} lanes, {'FMA' if self.fma else 'no FMA'}, "
            f"{'OpenMP' if self.openmp else 'one thread'}, {self.compiler})"
        )

    @property
    def numerics(self) -> str:
        """The part of the profile a kernel's bits depend on."""
        return f"{self.lanes} lanes, {'fma' if self.fma else 'no fma'}"


P, I64 = ctypes.c_void_p, ctypes.c_int64
# the paged attention's arguments: q and its row stride, the K and V caches, the block tables and their row stride,
# each query's table and context, out, N, H, K, D, the block size, the scale, the threads
PAGED_ATTENTION = [P, I64, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, ctypes.c_float, ctypes.c_int]
SIGNATURES = {  # symbol -> argument types (every one returns int)
    "toolkit_paged_attention_f32": PAGED_ATTENTION,
    "toolkit_paged_attention_q8": PAGED_ATTENTION + [P, P, I64, P],  # the scales and their stride, the fp8 table
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
    "toolkit_matmul_invariant_f32": [P, I64, P, P, I64, I64, I64, I64, ctypes.c_int, ctypes.c_int],
    "toolkit_matmul_invariant_h16": [P, I64, P, P, I64, I64, I64, I64, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    "toolkit_matmul_schedules": [],
    "toolkit_paged_attention_h16": PAGED_ATTENTION + [ctypes.c_int],  # the cache's 16-bit format
    "toolkit_round_h16": [P, I64, ctypes.c_int, ctypes.c_int],
    "toolkit_gumbel_sample_rows": [P, I64, I64, I64, P, P, P, P, P, ctypes.c_int],
    "toolkit_gumbel_noise": [P, I64, ctypes.c_uint32, ctypes.c_uint32, P],
    "toolkit_truncate_f32": [P, I64, I64, I64, ctypes.c_int, P, P, I64, P, ctypes.c_int],
    "toolkit_sample_tail_rows": [P, I64, I64, I64, P, P, P, P, P, P, P, P, I64, P, P, P, P, P, P, P, I64, ctypes.c_int],
    "toolkit_decoder_layers": [
        P,
        I64,
        P,
        P,
        P,
        P,
        P,
        P,
        P,
        P,
        P,
        P,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        P,  # another build's matmuls (fp32, 16-bit), or NULL: this build's
        P,
    ],
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
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines or ["(no output)"]
    return errors[0][:200]


def _compile_library(cc: str, flags: list[str], sources: list[Path], target: Path) -> str | None:
    """Compile the sources (in parallel, one process each) and link them into `target`; None, or the
    first error line."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in sources]
        procs = [
            subprocess.Popen(
                [cc, *flags, "-c", str(src), "-o", str(obj)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for src, obj in zip(sources, objects)
        ]
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


@cache
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


def _spec(name: str) -> tuple[str, int | None]:
    """A build's name as TOOLKIT_KERNEL_TARGET names it (a target, or target/lanes): (target, lanes)."""
    target, _, lanes = name.partition("/")
    return target, int(lanes) if lanes.isdigit() else None


def build_named(name: str) -> NativeLib:
    """The build of that name (x86-64-v3, x86-64-v3/4, ...) with $CC, as native() builds its own: compiled at
    most once per process (another build whose matmul runs some rows: toolkit.native.schedules)."""
    return build(*_spec(name), os.environ.get("CC") or None)


@cache
def _warn_once(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_consulted = 0  # how often this process's main thread was told the kernels are on: the suite's `native` marker check
_MAIN = threading.main_thread().ident
_PROBE = os.environ.get("TOOLKIT_NATIVE_PROBE")  # a file a child process creates once told they are on (the same)


def switched_off() -> bool:
    """Whether TOOLKIT_NATIVE (0, false, off or no) switches the native path off in this process. Every choice
    between a kernel and torch's fallback asks this (through native()), so the suite can tell which tests take
    a path that TOOLKIT_NATIVE=0 changes: those told "on" (consulted(), TOOLKIT_NATIVE_PROBE for child processes).
    One that set the switch off itself takes the same path whatever the switch was."""
    global _consulted, _PROBE
    off = os.environ.get("TOOLKIT_NATIVE", "1").strip().lower() in ("0", "false", "off", "no")
    if off:
        return True
    if threading.get_ident() == _MAIN:  # a test's own thread (an engine thread a test left behind is not it)
        _consulted += 1
    if _PROBE is not None:
        Path(_PROBE).touch()
        _PROBE = None
    return False


def consulted() -> int:
    """How often this process's main thread asked switched_off() so far and was told the kernels are on."""
    return _consulted


def native() -> NativeLib:
    """The process's build of the kernels (raises KernelUnavailable). The first failure of a build prints
    one warning line on stderr; with TOOLKIT_NATIVE=0 nothing is compiled and nothing is printed."""
    if switched_off():
        raise KernelUnavailable("native kernels are switched off (TOOLKIT_NATIVE=0; unset it to use them)")
    target, lanes = _spec(os.environ.get("TOOLKIT_KERNEL_TARGET") or host_target())
    result = _build(target, lanes, os.environ.get("CC") or None)
    if isinstance(result, KernelUnavailable):
        _warn_once(
            f"toolkit: warning: native CPU kernels unavailable ({result}); running the torch fallback "
            f"(slower; its logits differ in the last bits). Fix: install gcc or clang (apt-get install "
            f"gcc) or point CC at one; TOOLKIT_NATIVE=0 picks the fallback without this warning"
        )
        raise KernelUnavailable(f"{result} (fix: install gcc or clang, or point CC at one)")
    return result


def available() -> bool:
    """Whether the process's native kernels run here (built, and not switched off)."""
    return resolve_or_none(None) is not None


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


def resolve(lib: NativeLib | None) -> NativeLib:
    """`lib`, else the process's build (raises KernelUnavailable)."""
    return lib if lib is not None else native()


def resolve_or_none(lib: NativeLib | None) -> NativeLib | None:
    """The build to use, or None where the native kernels do not run (the caller takes torch's path)."""
    try:
        return resolve(lib)
    except KernelUnavailable:
        return None
