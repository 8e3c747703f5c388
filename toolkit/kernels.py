"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

The shared library is cached under $TOOLKIT_CACHE/kernels, keyed by the source (with the
shared headers), the compiler and the CPU's flags (it is built with -march=native). When no
compiler is available the caller falls back to the pure-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from toolkit.models.loading import cache_root

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-shared", "-fPIC", "-std=gnu11"]


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


@lru_cache(maxsize=None)
def _compile(name: str, extra_flags: tuple[str, ...] = ()):
    """Compile csrc/<name>.c once per (source, compiler, CPU flags) and load it (once per process)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler found (set CC)")
    source_path = CSRC / f"{name}.c"
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # + headers
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"cannot run {cc}: {exc}") from None
    flags = [*FLAGS, *extra_flags]  # a later flag wins
    key = hashlib.sha256(source + version.encode() + _cpu_flags().encode() + " ".join(flags).encode()).hexdigest()
    target = cache_root() / "kernels" / f"{name}-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
        os.close(fd)
        result = subprocess.run([cc, *flags, str(source_path), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise KernelUnavailable(f"compiling {source_path.name} failed: {result.stderr.strip()[:300]}")
        os.replace(tmp, target)
    return ctypes.CDLL(str(target))


def _load(name: str, symbol: str, argtypes: list, extra_flags: tuple[str, ...] = ()):
    """csrc/<name>.c's `symbol`, compiled on first use, with its ctypes signature (returns int)."""
    fn = getattr(_compile(name, extra_flags), symbol)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


P, I64 = ctypes.c_void_p, ctypes.c_int64


@lru_cache(maxsize=1)
def load_paged_attention():
    """The compiled `toolkit_paged_attention_f32` function (raises KernelUnavailable)."""
    return _load("paged_attention", "toolkit_paged_attention_f32",
                 [P, I64, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, ctypes.c_float, ctypes.c_int])


@lru_cache(maxsize=1)
def load_paged_attention_q8():
    """The compiled `toolkit_paged_attention_q8` function: an int8 / fp8 cache (raises KernelUnavailable)."""
    return _load("paged_attention", "toolkit_paged_attention_q8",
                 [P, I64, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, ctypes.c_float, ctypes.c_int, P, P, I64, P])


@lru_cache(maxsize=1)
def fp8_decode_table() -> torch.Tensor:
    """float32 value of every e4m3 byte (the kernel decodes fp8 through it)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().contiguous()


def quantized_kernel_supports(num_heads: int, head_dim: int) -> bool:
    return num_heads <= 32 and head_dim in (64, 128)


@lru_cache(maxsize=1)
def load_rope():
    """The compiled `toolkit_rope_f32` function (raises KernelUnavailable). No fused multiply-add:
    its bits are those of torch's `x * cos + rotate_half(x) * sin`."""
    return _load("rope", "toolkit_rope_f32", [P, I64, P, P, P, I64, P, I64, I64, I64, ctypes.c_int],
                 ("-ffp-contract=off",))


def available(loader) -> bool:
    """Whether a `load_*` function's kernel compiles and loads here."""
    try:
        loader()
        return True
    except KernelUnavailable:
        return False


def rope_cpu(x_NHD: torch.Tensor, cos_PD: torch.Tensor, sin_PD: torch.Tensor, positions_N: torch.Tensor) -> torch.Tensor:
    """x * cos[pos] + rotate_half(x) * sin[pos] for fp32 heads (N, heads, D) whose rows may be strided
    (a view into the fused q|k|v output); returns a new contiguous tensor."""
    n, h, d = x_NHD.shape
    if x_NHD.stride(2) != 1 or x_NHD.stride(1) != d:
        x_NHD = x_NHD.contiguous()
    out = torch.empty((n, h, d), dtype=torch.float32)
    positions_N = positions_N.contiguous()
    rc = load_rope()(x_NHD.data_ptr(), x_NHD.stride(0), out.data_ptr(), cos_PD.data_ptr(), sin_PD.data_ptr(),
                     cos_PD.shape[0], positions_N.data_ptr(), n, h, d, torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"a position is outside the rotary table of {cos_PD.shape[0]} positions")
    if rc != 0:
        raise KernelUnavailable(f"rope kernel refused head_dim {d}")
    return out


@lru_cache(maxsize=1)
def load_rowwise() -> dict:
    """The compiled row-wise kernels of csrc/rowwise.c by short name (raises KernelUnavailable)."""
    signatures = {"add_rms_norm": [P, I64, P, I64, P, ctypes.c_float, P, I64, I64, I64, ctypes.c_int],
                  "silu_mul": [P, I64, P, I64, I64, I64, ctypes.c_int],
                  "logsumexp": [P, I64, I64, I64, P, ctypes.c_int],
                  "argmax": [P, I64, I64, I64, P, ctypes.c_int]}
    return {name: _load("rowwise", f"toolkit_{name}_f32", argtypes) for name, argtypes in signatures.items()}


def _rows_ok(x: torch.Tensor) -> bool:
    """A 2-D fp32 CPU tensor whose rows are contiguous: what the row-wise kernels read in place."""
    return x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1


def logsumexp_cpu(x_RV: torch.Tensor) -> torch.Tensor | None:
    """logsumexp of each row (R,) in one C pass per row, or None where the kernel does not apply."""
    if not _rows_ok(x_RV) or not available(load_rowwise):
        return None
    out = torch.empty(x_RV.shape[0], dtype=torch.float32)
    load_rowwise()["logsumexp"](x_RV.data_ptr(), x_RV.stride(0), x_RV.shape[0], x_RV.shape[1], out.data_ptr(),
                                torch.get_num_threads())
    return out


def argmax_cpu(x_RV: torch.Tensor) -> list[int] | None:
    """torch.argmax(x, dim=-1) of each row (the first maximal index; a NaN counts as the maximum) in one
    C pass, or None where the kernel does not apply."""
    if not _rows_ok(x_RV) or x_RV.shape[1] == 0 or not available(load_rowwise):
        return None
    out = torch.empty(x_RV.shape[0], dtype=torch.int64)
    load_rowwise()["argmax"](x_RV.data_ptr(), x_RV.stride(0), x_RV.shape[0], x_RV.shape[1], out.data_ptr(),
                             torch.get_num_threads())
    return out.tolist()


def add_rms_norm_cpu(x_ND: torch.Tensor, residual_ND: torch.Tensor | None, weight_D: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm(x + residual) * weight) for fp32 rows in one pass; `x` is updated in place
    (it must be a tensor the caller owns) and returned; without a residual, just the norm."""
    n, d = x_ND.shape
    if x_ND.stride(1) != 1:
        x_ND = x_ND.contiguous()
    if residual_ND is not None and residual_ND.stride(1) != 1:
        residual_ND = residual_ND.contiguous()
    h = torch.empty((n, d), dtype=torch.float32)
    r_ptr, r_stride = (residual_ND.data_ptr(), residual_ND.stride(0)) if residual_ND is not None else (None, 0)
    rc = load_rowwise()["add_rms_norm"](x_ND.data_ptr(), x_ND.stride(0), r_ptr, r_stride, weight_D.data_ptr(), eps,
                                        h.data_ptr(), d, n, d, torch.get_num_threads())
    if rc != 0:
        raise KernelUnavailable(f"rms norm kernel refused width {d}")
    return x_ND, h


def silu_mul_cpu(gate_up_N2F: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from fp32 rows [gate | up] (a fused projection's output), in one pass."""
    n, f2 = gate_up_N2F.shape
    if gate_up_N2F.stride(1) != 1:
        gate_up_N2F = gate_up_N2F.contiguous()
    f = f2 // 2
    h = torch.empty((n, f), dtype=torch.float32)
    rc = load_rowwise()["silu_mul"](gate_up_N2F.data_ptr(), gate_up_N2F.stride(0), h.data_ptr(), f, n, f,
                                    torch.get_num_threads())
    if rc != 0:
        raise KernelUnavailable(f"silu kernel refused width {f}")
    return h


@lru_cache(maxsize=1)
def load_sha256_rows():
    """The compiled `toolkit_sha256_rows` function (raises KernelUnavailable)."""
    return _load("sha256_rows", "toolkit_sha256_rows", [P, P, I64, I64, P, ctypes.c_int])


def sha256_rows(rows_RB, index: "list[int] | None" = None, threads: int | None = None) -> list[str]:
    """The sha256 hex digest of the bytes of each row of a 2-D CPU tensor or numpy array (rows
    `index`, all by default), read in place: 16 rows per pass in C on `threads` threads (default
    torch's), the digests hashlib gives; hashlib row by row for one or two rows or without a compiler."""
    x = torch.from_numpy(rows_RB) if not isinstance(rows_RB, torch.Tensor) else rows_RB
    if x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"sha256_rows wants a 2-D CPU array, got shape {tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    index = list(range(x.shape[0])) if index is None else [int(i) for i in index]
    if any(not 0 <= i < x.shape[0] for i in index):
        raise IndexError(f"sha256_rows: a row index is outside the {x.shape[0]} rows")
    # a pass of 16 lanes costs about what hashlib takes for two rows
    if len(index) <= 2 or not available(load_sha256_rows):
        return [hashlib.sha256(x[i].numpy().view("uint8")).hexdigest() for i in index]
    fn = load_sha256_rows()
    offsets = torch.tensor(index, dtype=torch.int64) * (x.stride(0) * x.element_size())
    out = torch.empty((len(index), 32), dtype=torch.uint8)
    fn(x.data_ptr(), offsets.data_ptr(), len(index), x.shape[1] * x.element_size(), out.data_ptr(),
       threads or torch.get_num_threads())
    hexes = out.numpy().tobytes().hex()
    return [hexes[64 * i:64 * i + 64] for i in range(len(index))]


@lru_cache(maxsize=1)
def load_matmul_invariant():
    """The compiled `toolkit_matmul_invariant_f32` function (raises KernelUnavailable)."""
    return _load("matmul_invariant", "toolkit_matmul_invariant_f32", [P, I64, P, P, I64, I64, I64, I64, ctypes.c_int])


PANEL = 64  # NR of csrc/matmul_invariant.c


@dataclass(frozen=True)
class PackedWeight:
    """A (K, N) fp32 weight laid out panel by panel for the batch-invariant matmul."""

    data: torch.Tensor
    k: int
    n: int


def pack_weight(w_KN: torch.Tensor) -> PackedWeight:
    """Column panels of 64, then of 16, then the last N % 16 columns, each panel contiguous."""
    k, n = w_KN.shape
    wide, narrow = n // PANEL, (n % PANEL) // 16
    vec_end = wide * PANEL + narrow * 16
    parts = [w_KN[:, : wide * PANEL].reshape(k, wide, PANEL).permute(1, 0, 2).reshape(-1),
             w_KN[:, wide * PANEL: vec_end].reshape(k, narrow, 16).permute(1, 0, 2).reshape(-1),
             w_KN[:, vec_end:].reshape(-1)]
    return PackedWeight(torch.cat(parts).float().contiguous(), k, n)


def matmul_invariant(x_MK: torch.Tensor, w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """x @ w in fp32 with each output element summed over k in order, by one FMA chain: a row's
    result does not depend on the other rows, on M, or on the number of threads. `w` is (K, N),
    packed with `pack_weight` once (a plain tensor is packed on every call)."""
    packed = w if isinstance(w, PackedWeight) else pack_weight(w)
    if x_MK.dtype != torch.float32 or x_MK.device.type != "cpu":
        raise KernelUnavailable("the batch-invariant matmul runs fp32 on the CPU")
    if x_MK.stride(-1) != 1:
        x_MK = x_MK.contiguous()
    m = x_MK.shape[0]
    out = torch.empty((m, packed.n), dtype=torch.float32)
    load_matmul_invariant()(x_MK.data_ptr(), x_MK.stride(0), packed.data.data_ptr(), out.data_ptr(), packed.n,
                            m, packed.k, packed.n, torch.get_num_threads())
    return out


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


def paged_attention_cpu_q8(q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scales: torch.Tensor, v_scales: torch.Tensor, block_tables_SB: torch.Tensor,
                           query_table_N: torch.Tensor, query_ctx_N: torch.Tensor, scale: float,
                           out_NHD: torch.Tensor) -> torch.Tensor:
    """paged_attention_cpu over an int8 / fp8 cache with per-(block, KV head) scales ([blocks, K]) or
    static per-tensor ones ([K])."""
    n, h, d = q_NHD.shape
    _, bs, k, _ = k_cache.shape
    if q_NHD.stride(2) != 1 or q_NHD.stride(1) != d:
        q_NHD = q_NHD.contiguous()
    lut = fp8_decode_table().data_ptr() if k_cache.dtype == torch.float8_e4m3fn else None
    stride = k_scales.stride(0) if k_scales.dim() == 2 else 0
    rc = load_paged_attention_q8()(q_NHD.data_ptr(), q_NHD.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                   block_tables_SB.data_ptr(), block_tables_SB.stride(0), query_table_N.data_ptr(),
                                   query_ctx_N.data_ptr(), out_NHD.data_ptr(), n, h, k, d, bs, float(scale),
                                   torch.get_num_threads(), k_scales.data_ptr(), v_scales.data_ptr(), stride, lut)
    if rc != 0:
        raise KernelUnavailable(f"quantised paged attention kernel refused shapes H={h} K={k} D={d}")
    return out_NHD


@lru_cache(maxsize=1)
def load_decoder_layers():
    """The compiled `toolkit_decoder_layers` function and the addresses of the kernels it calls
    (matmul, add + RMSNorm, SiLU * up, RoPE, paged attention), as an int64 tensor (raises KernelUnavailable)."""
    fn = _load("decoder_layers", "toolkit_decoder_layers",
               [P, P, I64, P, P, P, P, P, P, P, P, P, P, ctypes.c_float, ctypes.c_float, ctypes.c_int])
    rowwise = load_rowwise()
    kernels = [load_matmul_invariant(), rowwise["add_rms_norm"], rowwise["silu_mul"], load_rope(),
               load_paged_attention()]
    return fn, torch.tensor([ctypes.cast(k, ctypes.c_void_p).value for k in kernels], dtype=torch.int64)


def decoder_layers_cpu(x_NE: torch.Tensor, layers_L8: torch.Tensor, dims: tuple[int, ...], positions_N: torch.Tensor,
                       slots_N: torch.Tensor, cos_PD: torch.Tensor, sin_PD: torch.Tensor, block_tables_SB: torch.Tensor,
                       query_table_N: torch.Tensor, query_ctx_N: torch.Tensor, eps: float, scale: float,
                       num_slots: int) -> None:
    """Run a Llama-style decoder's layers over the step's N tokens in one call (csrc/decoder_layers.c):
    `x` (N, hidden), contiguous, is updated in place to the last layer's residual stream. `layers_L8` holds
    each layer's addresses (ln_attn, ln_mlp, packed w_qkv, w_o, w_gate_up, w_down, K cache, V cache);
    dims = (N, hidden, heads, kv heads, head dim, MLP width, block size); a slot outside the cache's
    `num_slots` raises before anything is written."""
    fn, kernels = load_decoder_layers()
    n, e, h, k, d, f, bs = dims
    widths = [e, (h + 2 * k) * d, (h + k) * d, h * d, e, 2 * f, f, e]  # h, qkv, qk, attn, o, gate_up, act, m
    work = torch.empty(n * sum(widths), dtype=torch.float32)
    offsets = torch.tensor([0, *widths[:-1]], dtype=torch.int64).cumsum(0) * (n * 4) + work.data_ptr()
    all_dims = torch.tensor([n, e, h, k, d, f, bs, cos_PD.shape[0], block_tables_SB.stride(0), num_slots],
                            dtype=torch.int64)
    rc = fn(kernels.data_ptr(), layers_L8.data_ptr(), layers_L8.shape[0], all_dims.data_ptr(), x_NE.data_ptr(),
            offsets.data_ptr(), positions_N.data_ptr(), slots_N.data_ptr(), cos_PD.data_ptr(), sin_PD.data_ptr(),
            block_tables_SB.data_ptr(), query_table_N.data_ptr(), query_ctx_N.data_ptr(), eps, scale,
            torch.get_num_threads())
    if rc == -3:
        raise IndexError(f"a KV slot is outside the cache's {num_slots} slots")
    if rc == -2:
        raise IndexError(f"a position is outside the rotary table of {cos_PD.shape[0]} positions")
    if rc != 0:
        raise KernelUnavailable(f"a native decoder kernel refused the shapes {dims}")
