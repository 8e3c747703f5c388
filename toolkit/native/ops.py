"""The model's kernels as torch functions (the sampler's are toolkit.native.sampling_ops): each takes and returns
tensors, checks what it is given and calls one symbol of the process's build (or the `lib` passed)."""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from functools import lru_cache

import torch

from toolkit.native.library import KernelUnavailable, NativeLib, resolve
from toolkit.native.memory import huge_empty


@lru_cache(maxsize=1)
def fp8_decode_table() -> torch.Tensor:
    """float32 value of every e4m3 byte (the kernel decodes fp8 through it)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().contiguous()


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
    if resolve(lib).fn["round_h16"](x.data_ptr(), x.numel(), H16_KINDS[dtype], torch.get_num_threads()) != 0:
        raise ValueError(f"no 16-bit format {dtype}")
    return x


def rope_cpu(
    x_NHD: torch.Tensor,
    cos_PD: torch.Tensor,
    sin_PD: torch.Tensor,
    positions_N: torch.Tensor,
    lib: NativeLib | None = None,
) -> torch.Tensor:
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
    rc = resolve(lib).fn["rope"](
        x_NHD.data_ptr(),
        x_NHD.stride(0),
        out.data_ptr(),
        cos_PD.data_ptr(),
        sin_PD.data_ptr(),
        cos_PD.shape[0],
        positions_N.data_ptr(),
        n,
        h,
        d,
        torch.get_num_threads(),
    )
    if rc == -2:
        raise IndexError(f"a position is outside the rotary table of {cos_PD.shape[0]} positions")
    if rc != 0:
        raise KernelUnavailable(f"rope kernel refused head_dim {d}")
    return out


def add_rms_norm_cpu(
    x_ND: torch.Tensor,
    residual_ND: torch.Tensor | None,
    weight_D: torch.Tensor,
    eps: float,
    lib: NativeLib | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm(x + residual) * weight) for fp32 rows in one pass; `x` is updated in place
    (it must be a tensor the caller owns) and returned; without a residual, just the norm. bf16 / fp16 rows
    are computed in fp32 and both outputs rounded back (x then is a new tensor, or without a residual x itself:
    the norm leaves it as it is)."""
    if x_ND.dtype != torch.float32:
        dtype = x_ND.dtype
        x32, h32 = add_rms_norm_cpu(
            x_ND.float(), None if residual_ND is None else _fp32(residual_ND), _fp32(weight_D), eps, lib
        )
        return x_ND if residual_ND is None else x32.to(dtype), h32.to(dtype)
    n, d = x_ND.shape
    if x_ND.stride(1) != 1:
        x_ND = x_ND.contiguous()
    if residual_ND is not None and residual_ND.stride(1) != 1:
        residual_ND = residual_ND.contiguous()
    h = torch.empty((n, d), dtype=torch.float32)
    r_ptr, r_stride = (residual_ND.data_ptr(), residual_ND.stride(0)) if residual_ND is not None else (None, 0)
    resolve(lib).fn["add_rms_norm"](
        x_ND.data_ptr(),
        x_ND.stride(0),
        r_ptr,
        r_stride,
        weight_D.data_ptr(),
        eps,
        h.data_ptr(),
        d,
        n,
        d,
        torch.get_num_threads(),
    )
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
    resolve(lib).fn["silu_mul"](
        gate_up_N2F.data_ptr(), gate_up_N2F.stride(0), h.data_ptr(), f, n, f, torch.get_num_threads()
    )
    return h


@dataclass(frozen=True)
class PackedWeight:
    """A (K, N) fp32, bf16 or fp16 weight laid out panel by panel for the batch-invariant matmul of builds
    whose wide panels are `panel` columns and narrow ones `lanes` (`data` keeps the weight's format)."""

    data: torch.Tensor
    k: int
    n: int
    panel: int
    lanes: int


def pack_weight(w_KN: torch.Tensor, lib: NativeLib | None = None, out: torch.Tensor | None = None) -> PackedWeight:
    """Column panels of the build's wide panel width, then of its lanes, then the last N % lanes
    columns, each panel contiguous; in a bf16 wide panel each k's blocks of `lanes` columns are interleaved
    in pairs (weight by weight), which the kernel widens two blocks at a time. `out`: K * N elements of the
    weight's format to pack into (a model's weights in one huge-page arena: packed_arena)."""
    lib = resolve(lib)
    nr, vl = lib.panel, lib.lanes
    k, n = w_KN.shape
    wide, narrow = n // nr, (n % nr) // vl
    vec_end = wide * nr + narrow * vl
    if w_KN.dtype not in FLOATS:
        raise KernelUnavailable(f"the batch-invariant matmul reads fp32, bf16 or fp16 weights, not {w_KN.dtype}")
    if out is not None and (out.shape != (k * n,) or out.dtype != w_KN.dtype or not out.is_contiguous()):
        raise ValueError(f"pack_weight: out must be {k * n} contiguous {w_KN.dtype} elements")
    data = torch.empty(k * n, dtype=w_KN.dtype) if out is None else out  # each part copied into place once
    panels = w_KN[:, : wide * nr].reshape(k, wide, nr).permute(1, 0, 2)
    if w_KN.dtype == torch.bfloat16:  # each k's column blocks in interleaved pairs (csrc/matmul_invariant.c)
        panels = panels.reshape(wide, k, nr // (2 * vl), 2, vl).transpose(3, 4)
    data[: k * wide * nr].view(panels.shape).copy_(panels)
    data[k * wide * nr : k * vec_end].view(narrow, k, vl).copy_(
        w_KN[:, wide * nr : vec_end].reshape(k, narrow, vl).permute(1, 0, 2)
    )
    data[k * vec_end :].view(k, n - vec_end).copy_(w_KN[:, vec_end:])
    return PackedWeight(data, k, n, nr, vl)


def packed_arena(weights: list[torch.Tensor], lib: NativeLib | None = None) -> list[PackedWeight]:
    """Each (K, N) weight packed (pack_weight), all of them in one buffer on huge pages where the kernel gives them
    (toolkit.native.memory: a decode step streams them all), each starting on a 64-byte line."""
    lib = resolve(lib)
    if not weights:
        return []
    dtype = weights[0].dtype
    if any(w.dtype != dtype for w in weights):
        return [pack_weight(w, lib) for w in weights]
    return [pack_weight(w, lib, out) for w, out in zip(weights, arena([w.numel() for w in weights], dtype))]


def arena(numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """1-D tensors of `numels` elements, one after another in one buffer on huge pages where the kernel gives them
    (toolkit.native.memory), each starting on a 64-byte line."""
    line = 64 // dtype.itemsize
    starts, total = [], 0
    for n in numels:
        starts.append(total)
        total += -(-n // line) * line
    buffer = huge_empty(total, dtype)
    return [buffer[s : s + n] for n, s in zip(numels, starts)]


def fixed_schedule(rows: int) -> int:
    """The matmul's schedule for `rows` rows when none is chosen (toolkit.native.schedules.FIXED): pairs for one row,
    tiles for more."""
    return 1 if rows == 1 else 0


def matmul_invariant(
    x_MK: torch.Tensor,
    w: torch.Tensor | PackedWeight,
    lib: NativeLib | None = None,
    schedule: int | None = None,
    as_fp32: bool = False,
) -> torch.Tensor:
    """x @ w in fp32 with each output element summed over k in order, by one FMA chain: a row's
    result does not depend on the other rows, on M, on the number of threads or on the `schedule` (the loops
    that stream the weights: toolkit.native.schedules; None: the fixed choice for the rows). `w` is (K, N), packed
    with `pack_weight` once (a plain tensor is packed on every call). The result is in x's format; `as_fp32` gives
    a 16-bit x's result as fp32 holding the same values (rounded in place: what `.to(x.dtype).float()` gives,
    without the two copies: a step's logits)."""
    lib = resolve(lib)
    packed = w if isinstance(w, PackedWeight) else pack_weight(w, lib)
    if (packed.panel, packed.lanes) != (lib.panel, lib.lanes):
        raise ValueError(
            f"weight packed for panels of {packed.panel}/{packed.lanes} columns, this build reads "
            f"{lib.panel}/{lib.lanes}: pack it with this build"
        )
    if x_MK.dtype not in FLOATS or x_MK.device.type != "cpu":
        raise KernelUnavailable("the batch-invariant matmul runs fp32, bf16 or fp16 on the CPU")
    dtype = x_MK.dtype
    x_MK = _fp32(x_MK)
    if x_MK.stride(-1) != 1:
        x_MK = x_MK.contiguous()
    m = x_MK.shape[0]
    schedule = fixed_schedule(m) if schedule is None else schedule
    out = torch.empty((m, packed.n), dtype=torch.float32)
    args = (
        x_MK.data_ptr(),
        x_MK.stride(0),
        packed.data.data_ptr(),
        out.data_ptr(),
        packed.n,
        m,
        packed.k,
        packed.n,
        torch.get_num_threads(),
    )
    if packed.data.dtype == torch.float32:
        rc = lib.fn["matmul_invariant"](*args, schedule)
    else:
        rc = lib.fn["matmul_invariant_h16"](*args, H16_KINDS[packed.data.dtype], schedule)
    if rc != 0:
        raise ValueError(f"no matmul schedule {schedule} (this build has {lib.fn['matmul_schedules']()})")
    if dtype == torch.float32:
        return out
    return round_h16(out, dtype, lib) if as_fp32 else out.to(dtype)


def paged_attention_cpu(
    q_NHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables_SB: torch.Tensor,
    query_table_N: torch.Tensor,
    query_ctx_N: torch.Tensor,
    scale: float,
    out_NHD: torch.Tensor | None = None,
    lib: NativeLib | None = None,
) -> torch.Tensor:
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
    args = _attention_args(q_NHD, k_cache, v_cache, block_tables_SB, query_table_N, query_ctx_N, out, scale)
    if k_cache.dtype == torch.float32:
        rc = resolve(lib).fn["paged_attention"](*args)
    else:
        rc = resolve(lib).fn["paged_attention_h16"](*args, H16_KINDS[k_cache.dtype])
    if rc != 0:
        raise KernelUnavailable(
            f"paged attention kernel refused shapes H={h} K={k} D={d} block_size={bs} over a {k_cache.dtype} cache"
        )
    if direct or dtype == torch.float32:
        return out
    if out_NHD is None:
        return out.to(dtype)
    return out_NHD.copy_(out)


def paged_attention_cpu_q8(
    q_NHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    block_tables_SB: torch.Tensor,
    query_table_N: torch.Tensor,
    query_ctx_N: torch.Tensor,
    scale: float,
    out_NHD: torch.Tensor,
    lib: NativeLib | None = None,
) -> torch.Tensor:
    """paged_attention_cpu over an int8 / fp8 cache with per-(block, KV head) scales ([blocks, K]) or
    static per-tensor ones ([K]); bf16 / fp16 queries in fp32, the output rounded into `out_NHD`."""
    if q_NHD.dtype != torch.float32:
        out32 = paged_attention_cpu_q8(
            q_NHD.float(),
            k_cache,
            v_cache,
            _fp32(k_scales),
            _fp32(v_scales),
            block_tables_SB,
            query_table_N,
            query_ctx_N,
            scale,
            torch.empty(q_NHD.shape, dtype=torch.float32),
            lib,
        )
        return out_NHD.copy_(out32)
    _, h, d = q_NHD.shape
    k = k_cache.shape[2]
    if q_NHD.stride(2) != 1 or q_NHD.stride(1) != d:
        q_NHD = q_NHD.contiguous()
    lut = fp8_decode_table().data_ptr() if k_cache.dtype == torch.float8_e4m3fn else None
    stride = k_scales.stride(0) if k_scales.dim() == 2 else 0
    rc = resolve(lib).fn["paged_attention_q8"](
        *_attention_args(q_NHD, k_cache, v_cache, block_tables_SB, query_table_N, query_ctx_N, out_NHD, scale),
        k_scales.data_ptr(),
        v_scales.data_ptr(),
        stride,
        lut,
    )
    if rc != 0:
        raise KernelUnavailable(f"quantised paged attention kernel refused shapes H={h} K={k} D={d}")
    return out_NHD


def _attention_args(q_NHD, k_cache, v_cache, block_tables_SB, query_table_N, query_ctx_N, out_NHD, scale) -> tuple:
    """The paged-attention kernels' common arguments, as C takes them: pointers and row strides, then the shapes
    (N, H, K, D, block size), the scale and the threads."""
    n, h, d = q_NHD.shape
    _, bs, k, _ = k_cache.shape
    return (
        q_NHD.data_ptr(),
        q_NHD.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables_SB.data_ptr(),
        block_tables_SB.stride(0),
        query_table_N.data_ptr(),
        query_ctx_N.data_ptr(),
        out_NHD.data_ptr(),
        n,
        h,
        k,
        d,
        bs,
        float(scale),
        torch.get_num_threads(),
    )


def decoder_layers_cpu(
    x_NE: torch.Tensor,
    layers_L8: torch.Tensor,
    dims: tuple[int, ...],
    positions_N: torch.Tensor,
    slots_N: torch.Tensor,
    cos_PD: torch.Tensor,
    sin_PD: torch.Tensor,
    block_tables_SB: torch.Tensor,
    query_table_N: torch.Tensor,
    query_ctx_N: torch.Tensor,
    eps: float,
    scale: float,
    num_slots: int,
    lib: NativeLib | None = None,
    kind: int = 0,
    schedule: int | None = None,
    matmul_lib: NativeLib | None = None,
) -> None:
    """Run a Llama-style decoder's layers over the step's N tokens in one call (csrc/decoder_layers.c):
    `x` (N, hidden), contiguous, is updated in place to the last layer's residual stream. `layers_L8` holds
    each layer's addresses (ln_attn, ln_mlp, packed w_qkv, w_o, w_gate_up, w_down, K cache, V cache);
    dims = (N, hidden, heads, kv heads, head dim, MLP width, block size); a slot outside the cache's
    `num_slots` raises before anything is written. A bf16 / fp16 model passes x in its format, 16-bit packed
    projections and caches and fp32 norm weights: every operation's outputs are rounded to that format.
    `schedule`: the matmuls' loops for N rows (toolkit.native.schedules; None: the fixed choice), which change no
    bit. `matmul_lib`: another FMA build whose matmul runs the projections (packed for its panels), which changes
    no bit either; None, `lib`'s own."""
    if x_NE.dtype != torch.float32:
        x32 = x_NE.float()
        decoder_layers_cpu(
            x32,
            layers_L8,
            dims,
            positions_N,
            slots_N,
            cos_PD,
            sin_PD,
            block_tables_SB,
            query_table_N,
            query_ctx_N,
            eps,
            scale,
            num_slots,
            lib,
            kind=H16_KINDS[x_NE.dtype],
            schedule=schedule,
            matmul_lib=matmul_lib,
        )
        x_NE.copy_(x32)  # exact: rounded already
        return
    n, e, h, k, d, f, bs = dims
    schedule = fixed_schedule(n) if schedule is None else schedule
    widths = [e, (h + 2 * k) * d, (h + k) * d, h * d, e, 2 * f, f, e]  # h, qkv, qk, attn, o, gate_up, act, m
    work = torch.empty(n * sum(widths), dtype=torch.float32)
    starts = itertools.accumulate(widths[:-1], initial=0)  # each buffer's first element, in rows' widths
    offsets = torch.tensor([work.data_ptr() + 4 * n * start for start in starts])
    all_dims = torch.tensor(
        [n, e, h, k, d, f, bs, cos_PD.shape[0], block_tables_SB.stride(0), num_slots], dtype=torch.int64
    )
    lib = resolve(lib)
    mm = (None, None)
    if matmul_lib is not None and matmul_lib is not lib:
        fma = lib.profile.fma and matmul_lib.profile.fma
        if not fma:  # without FMA a build's matmul rounds each product: its bits follow the build
            raise ValueError(f"{matmul_lib!r}'s matmul gives {lib!r}'s bits only where both have FMA")
        mm = tuple(
            ctypes.cast(matmul_lib.fn[f], ctypes.c_void_p).value for f in ("matmul_invariant", "matmul_invariant_h16")
        )
    rc = lib.fn["decoder_layers"](
        layers_L8.data_ptr(),
        layers_L8.shape[0],
        all_dims.data_ptr(),
        x_NE.data_ptr(),
        offsets.data_ptr(),
        positions_N.data_ptr(),
        slots_N.data_ptr(),
        cos_PD.data_ptr(),
        sin_PD.data_ptr(),
        block_tables_SB.data_ptr(),
        query_table_N.data_ptr(),
        query_ctx_N.data_ptr(),
        eps,
        scale,
        torch.get_num_threads(),
        kind,
        schedule,
        *mm,
    )
    if rc == -3:
        raise IndexError(f"a KV slot is outside the cache's {num_slots} slots")
    if rc == -2:
        raise IndexError(f"a position is outside the rotary table of {cos_PD.shape[0]} positions")
    if rc != 0:
        raise KernelUnavailable(f"a native decoder kernel refused the shapes {dims}")
