"""The engine's kernels on a CUDA GPU, in Triton (issues 56 and 57). Every output row is reduced in one fixed order
whatever the number of rows, so a request's logits do not depend on what it is batched with; and each replaces
two to ten of torch's launches, which is what a decode step on a GPU is bound by.

The batch-invariant mode's matmul is toolkit.native.gpu_matmul's; the paged attention toolkit.native.gpu_attention's.

One program a row or token, every mode (`routes`: the decoder, attention and sampler send a CUDA tensor here):
- `add_rms_norm`: the residual add rounded to the format, then HF's RMSNorm (fp32 statistics, rounded, scaled);
  `rms_norm`: the norm alone (the same kernel without its residual);
- `rope`: HF's RoPE of every head of a token, each op rounded as torch's (the same bits); `rope_write_kv`: the same,
  with the roped keys and the values stored into the token's cache slot (the step's cache writes);
- `silu_mul`: silu(gate) * up of a fused projection;
- `logsumexp`: an online max-and-sum over BLOCK_V slices in order.

Where Triton does not import, or the tensors are on the CPU without TRITON_INTERPRET=1, rms_norm and logsumexp
compute the same reduction with torch, one row at a time (`*_rows`): slow, and batch-invariant by
construction. CI runs the Triton kernels under TRITON_INTERPRET=1 at small shapes (tests/test_invariant_gpu.py),
the engine's GPU forward included.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch fallback below
    triton = tl = None

# every launch: no contraction of a multiply and an add into an FMA (Triton's default differs between versions, and
# the bits would with it)
FIXED = {"enable_fp_fusion": False}
BLOCK_V = 1024  # logsumexp's slice of a row


def available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run on `t`: Triton imports, and `t` is on a GPU, or on the CPU under
    TRITON_INTERPRET=1 (Triton's interpreter, what CI runs)."""
    if triton is None:
        return False
    return t.device.type == "cuda" or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def routes(t: torch.Tensor) -> bool:
    """Whether the engine runs the ops on `t` through these kernels: `t` on a CUDA GPU, Triton imported. (A CPU
    test widens it to `available`, to run the engine's GPU path in Triton's interpreter.)"""
    return triton is not None and t.is_cuda


if triton is not None:

    @triton.jit
    def rounded(y, dtype: tl.constexpr):
        """fp32 -> dtype, round to nearest even, as an fp32 value. bf16 by integer rounding of the fp32 bits (then
        exact): Triton's interpreter truncates a bf16 conversion, a GPU rounds it; this is both's nearest-even. A NaN
        is the quiet NaN: the rounding carry would turn a GPU's NaN (all mantissa bits set, 0x7FFFFFFF) into -0.0,
        and truncating a NaN whose payload is in its low bits gives inf."""
        if dtype == tl.bfloat16:
            bits = y.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            return tl.where(y == y, bits.to(tl.float32, bitcast=True), float("nan"))
        return y.to(dtype).to(tl.float32)

    @triton.jit
    def _logsumexp_kernel(x_ptr, out_ptr, V, sx, BV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BV)
        peak = tl.full((BV,), float("-inf"), dtype=tl.float32)
        for v0 in range(0, V, BV):
            x = tl.load(x_ptr + row * sx + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
            peak = tl.maximum(peak, x)
        m = tl.max(peak, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)  # a row of -inf: exp(-inf) = 0, its log -inf
        total = tl.zeros((BV,), dtype=tl.float32)
        for v0 in range(0, V, BV):
            x = tl.load(x_ptr + row * sx + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
            total += tl.exp(x - m)
        lse = m + tl.log(tl.sum(total, axis=0))
        tl.store(out_ptr + row, tl.where(m == float("inf"), m, lse))  # a +inf logit: +inf, as torch


# the step's kernels (the decoder's ops on a GPU)
if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, D, sx, sr, ss, so, eps, HAS_RES: tl.constexpr, BD: tl.constexpr
    ):
        """One program a row, the whole row at once: s = x + r rounded to the format (stored), then HF's RMSNorm of
        s (fp32 squares summed by one fixed tree, rounded to the format, times the weight, rounded)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BD)
        mask = cols < D
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
        s = x.to(tl.float32)
        if HAS_RES:
            s = rounded(s + tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0).to(tl.float32), x.dtype)
            tl.store(sum_ptr + row * ss + cols, s.to(x.dtype), mask=mask)
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(s * s, axis=0), D * 1.0) + eps))  # IEEE-rounded
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = rounded(s * inv, x.dtype)
        tl.store(out_ptr + row * so + cols, rounded(w * y, x.dtype).to(x.dtype), mask=mask)

    @triton.jit
    def _rope_kernel(
        x_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        out_ptr,
        H,
        sxn,
        sxh,
        son,
        soh,
        sc,
        v_ptr,
        slot_ptr,
        kc_ptr,
        vc_ptr,
        QH,
        svn,
        svh,
        scs,
        sch,
        BH: tl.constexpr,
        D: tl.constexpr,
        BD: tl.constexpr,
        BK: tl.constexpr,
        STORE: tl.constexpr,
    ):
        """One program a token, every head: x * cos + rotate_half(x) * sin with cos and sin rounded to the format
        and each product and the sum rounded to it, as torch's elementwise ops in that format do. A head of D
        dimensions in a tile of BD (a power of two), the rest masked. With STORE, heads from QH on are keys: they
        go to their slot of the key cache instead of out (rounded to the cache's format), and the token's values
        (v_ptr, BK heads a tile) to the same slot of the value cache: the step's cache writes in the same kernel."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)[:, None]
        d = tl.arange(0, BD)[None, :]
        half = D // 2
        partner = (d + half) % D
        mask = (h < H) & (d < D)
        x = tl.load(x_ptr + n * sxn + h * sxh + d, mask=mask, other=0.0)
        xr = tl.load(x_ptr + n * sxn + h * sxh + partner, mask=mask, other=0.0).to(tl.float32)
        xr = tl.where(d < half, -xr, xr)
        pos = tl.load(pos_ptr + n)
        c = rounded(tl.load(cos_ptr + pos * sc + d, mask=d < D, other=0.0), x.dtype)
        sn = rounded(tl.load(sin_ptr + pos * sc + d, mask=d < D, other=0.0), x.dtype)
        y = rounded(rounded(x.to(tl.float32) * c, x.dtype) + rounded(xr * sn, x.dtype), x.dtype)
        if STORE:
            tl.store(out_ptr + n * son + h * soh + d, y.to(x.dtype), mask=mask & (h < QH))
            slot = tl.load(slot_ptr + n).to(tl.int64)
            cache_t: tl.constexpr = kc_ptr.dtype.element_ty
            keys = kc_ptr + slot * scs + (h - QH) * sch + d
            tl.store(keys, rounded(y, cache_t).to(cache_t), mask=mask & (h >= QH))
            vh = tl.arange(0, BK)[:, None]
            vmask = (vh < H - QH) & (d < D)
            v = tl.load(v_ptr + n * svn + vh * svh + d, mask=vmask, other=0.0).to(tl.float32)
            tl.store(vc_ptr + slot * scs + vh * sch + d, rounded(v, cache_t).to(cache_t), mask=vmask)
        else:
            tl.store(out_ptr + n * son + h * soh + d, y.to(x.dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, width, sx, so, BW: tl.constexpr):
        """silu(gate) rounded to the format, times up, rounded (torch's two ops): gate | up halves of each row."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BW + tl.arange(0, BW)
        mask = cols < width
        g = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * sx + width + cols, mask=mask, other=0.0).to(tl.float32)
        g32 = g.to(tl.float32)
        a = rounded(tl.div_rn(g32, 1.0 + tl.exp(-g32)), g.dtype)
        tl.store(out_ptr + row * so + cols, rounded(a * u, g.dtype).to(g.dtype), mask=mask)


def add_rms_norm(
    x_ND: torch.Tensor, residual_ND: torch.Tensor | None, weight_D: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm of it), one kernel a step (HF's order: normalised in fp32, rounded to the format,
    times the weight). residual None: (x, RMSNorm of x)."""
    n, dim = x_ND.shape
    x_ND = x_ND.contiguous()
    total = torch.empty_like(x_ND) if residual_ND is not None else x_ND
    out = torch.empty_like(x_ND)
    res = residual_ND.contiguous() if residual_ND is not None else x_ND
    if n:
        _add_rms_norm_kernel[(n,)](
            x_ND,
            res,
            weight_D,
            total,
            out,
            dim,
            x_ND.stride(0),
            res.stride(0),
            total.stride(0),
            out.stride(0),
            eps,
            HAS_RES=residual_ND is not None,
            BD=triton.next_power_of_2(dim),
            **FIXED,
        )
    return total, out


def rope(x_NHD: torch.Tensor, cos_PD: torch.Tensor, sin_PD: torch.Tensor, positions_N: torch.Tensor) -> torch.Tensor:
    """HF's RoPE (x * cos + rotate_half(x) * sin, in x's format) of every head of every token, one kernel; x may
    be a strided view (the q | k part of the fused projection)."""
    return _rope(x_NHD, cos_PD, sin_PD, positions_N)


def rope_write_kv(
    qk_NHD: torch.Tensor,
    v_NKD: torch.Tensor,
    cos_PD: torch.Tensor,
    sin_PD: torch.Tensor,
    positions_N: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping_N: torch.Tensor,
) -> torch.Tensor:
    """RoPE of the q | k heads and the step's cache writes in one kernel (where torch spends two index copies more):
    returns q's heads (N, H, D); k's heads, roped, and v's go to their token's slot of each cache, rounded to its
    format (toolkit.kv.attention.write_kv's bits)."""
    return _rope(qk_NHD, cos_PD, sin_PD, positions_N, (v_NKD, slot_mapping_N, k_cache, v_cache), v_NKD.shape[1])


def _rope(x_NHD, cos_PD, sin_PD, positions_N, store=None, kv_heads: int = 0) -> torch.Tensor:
    n, heads, dim = x_NHD.shape
    out = torch.empty((n, heads - kv_heads, dim), dtype=x_NHD.dtype, device=x_NHD.device)
    if store is not None:
        v, slots, k_cache, v_cache = store
        k_flat, v_flat = (c.view(-1, kv_heads, dim) for c in (k_cache, v_cache))
        assert k_flat.stride() == v_flat.stride() and k_flat.dtype == v_flat.dtype, "the caches share one layout"
        cache = (v, slots, k_flat, v_flat, heads - kv_heads, v.stride(0), v.stride(1), *k_flat.stride()[:2])
    else:
        cache = (x_NHD, positions_N, x_NHD, x_NHD, heads, 0, 0, 0, 0)  # unread
    if n:
        _rope_kernel[(n,)](
            x_NHD,
            cos_PD,
            sin_PD,
            positions_N,
            out,
            heads,
            x_NHD.stride(0),
            x_NHD.stride(1),
            out.stride(0),
            out.stride(1),
            cos_PD.stride(0),
            *cache,
            BH=triton.next_power_of_2(heads),
            D=dim,
            BD=triton.next_power_of_2(dim),
            BK=triton.next_power_of_2(max(kv_heads, 1)),
            STORE=store is not None,
            **FIXED,
        )
    return out


def silu_mul(x_N2I: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate | up projection, one kernel."""
    n, width = x_N2I.shape[0], x_N2I.shape[1] // 2
    out = torch.empty((n, width), dtype=x_N2I.dtype, device=x_N2I.device)
    if n:
        block = 1024
        _silu_mul_kernel[(n, triton.cdiv(width, block))](
            x_N2I, out, width, x_N2I.stride(0), out.stride(0), BW=block, **FIXED
        )
    return out


def rms_norm(x_MD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row in fp32, rounded to x's format, times the weight (HF's order), one order a row."""
    if not available(x_MD):
        return rms_norm_rows(x_MD, weight_D, eps)
    return add_rms_norm(x_MD, None, weight_D, eps)[1]  # the fused kernel without its residual


def logsumexp(x_RV: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row, (R,) fp32, one order a row."""
    if not available(x_RV):
        return logsumexp_rows(x_RV)
    x_RV = x_RV.contiguous()
    out = torch.empty(x_RV.shape[0], dtype=torch.float32, device=x_RV.device)
    if not x_RV.shape[0]:
        return out
    _logsumexp_kernel[(x_RV.shape[0],)](x_RV, out, x_RV.shape[1], x_RV.stride(0), BV=BLOCK_V, **FIXED)
    return out


# the torch fallback: each row alone, so the library's kernel choice cannot depend on the batch


def rms_norm_rows(x_MD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    rows = []
    for i in range(x_MD.shape[0]):
        x32 = x_MD[i : i + 1].float()
        rows.append(weight_D * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x_MD.dtype))
    return torch.cat(rows) if rows else torch.empty_like(x_MD)


def logsumexp_rows(x_RV: torch.Tensor) -> torch.Tensor:
    return (
        torch.cat([torch.logsumexp(x_RV[i : i + 1].float(), dim=-1) for i in range(x_RV.shape[0])])
        if x_RV.shape[0]
        else torch.empty(0, device=x_RV.device)
    )
