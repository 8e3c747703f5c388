"""Batch-invariant kernels for a GPU, in Triton (issue 57): every output row is reduced in one fixed order whatever
the number of rows, so a request's logits do not depend on what it is batched with.

- `matmul(x_MK, w_KN)`: one fixed tiling (BLOCK_M x BLOCK_N tiles, BLOCK_K slices of K taken in ascending order), no
  split-K, fp32 sums (16-bit inputs widened as they are read). A tile's row is the sum over K of its own products:
  each slice's products are reduced by `tl.sum` (a fixed tree over BLOCK_K) and added to the running sum in order,
  never through `tl.dot`, whose tile multiply (tensor cores on a GPU, numpy's BLAS in the interpreter) may group a
  row's products differently with its tile's other rows.
- `rms_norm(x_MD, w_D, eps)`: one program a row, its squares summed in BLOCK_D slices in order; 16-bit inputs in
  fp32, the result rounded to the input's format, then scaled by the weight (HF's order).
- `logsumexp(x_RV)`: one program a row, an online max-and-sum over BLOCK_V slices in order.

Where Triton does not import, or the tensors are on the CPU without TRITON_INTERPRET=1, each function computes the
same reduction with torch, one row at a time (`*_rows`): slow, and batch-invariant by construction. CI runs the
Triton kernels under TRITON_INTERPRET=1 at small shapes (tests/test_invariant_gpu.py).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch fallback below
    triton = tl = None

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # the matmul's one tiling
BLOCK_D = 256  # rms_norm's slice of a row
BLOCK_V = 1024  # logsumexp's slice of a row


def available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run on `t`: Triton imports, and `t` is on a GPU, or on the CPU under
    TRITON_INTERPRET=1 (Triton's interpreter, what CI runs)."""
    if triton is None:
        return False
    return t.device.type == "cuda" or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    @triton.jit
    def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sxm, sxk, swk, swn, som, son,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):  # ascending slices of K: the one order of every row's sum
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0).to(tl.float32)
            w = tl.load(w_ptr + kk[:, None] * swk + rn[None, :] * swn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                        other=0.0).to(tl.float32)
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _matmul_dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sxm, sxk, swk, swn, som, son,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
        """The same fixed tiling, each slice's tile product by `tl.dot` (the tensor cores on a GPU): a row's
        products go through the MMA instruction's own fixed order, the same whatever the tile's other rows hold;
        fp32 at PRECISION "ieee" (never TF32)."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + kk[:, None] * swk + rn[None, :] * swn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                        other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _rounded(y, dtype: tl.constexpr):
        """fp32 -> dtype, round to nearest even, as an fp32 value. bf16 by integer rounding of the fp32 bits (then
        exact): Triton's interpreter truncates a bf16 conversion, a GPU rounds it; this is both's nearest-even."""
        if dtype == tl.bfloat16:
            bits = y.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            return bits.to(tl.float32, bitcast=True)
        return y.to(dtype).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, sx, so, eps, BD: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BD)
        total = tl.zeros((BD,), dtype=tl.float32)
        for d0 in range(0, D, BD):
            x = tl.load(x_ptr + row * sx + d0 + cols, mask=d0 + cols < D, other=0.0).to(tl.float32)
            total += x * x
        inv = 1.0 / tl.sqrt(tl.sum(total, axis=0) / D + eps)
        for d0 in range(0, D, BD):
            mask = d0 + cols < D
            x = tl.load(x_ptr + row * sx + d0 + cols, mask=mask, other=0.0)
            w = tl.load(w_ptr + d0 + cols, mask=mask, other=0.0)
            # rounded to the format, then scaled: a 16-bit product of two 16-bit values is exact in fp32, so
            # widening both and rounding once is the 16-bit multiply (and never 16-bit arithmetic, which
            # Triton's interpreter does not have)
            y = _rounded(x.to(tl.float32) * inv, x.dtype)
            tl.store(out_ptr + row * so + d0 + cols, _rounded(w.to(tl.float32) * y, x.dtype).to(x.dtype), mask=mask)

    @triton.jit
    def _logsumexp_kernel(x_ptr, out_ptr, V, sx, BV: tl.constexpr):
        row = tl.program_id(0)
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
        tl.store(out_ptr + row, m + tl.log(tl.sum(total, axis=0)))


def matmul(x_MK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    """x @ w, (M, N) fp32, each row's sums in one order whatever M is."""
    m, k = x_MK.shape
    n = w_KN.shape[1]
    if not available(x_MK):
        return matmul_rows(x_MK, w_KN)
    out = torch.empty((m, n), dtype=torch.float32, device=x_MK.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](x_MK, w_KN, out, m, n, k, x_MK.stride(0), x_MK.stride(1), w_KN.stride(0), w_KN.stride(1),
                         out.stride(0), out.stride(1), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return out


DOT_BLOCKS = (64, 64, 64)  # matmul_dot's one tiling (BLOCK_M x BLOCK_N tiles, BLOCK_K slices)


def matmul_dot(x_MK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    """x @ w by tensor-core tile products in one fixed tiling, no split-K (GPU only: the interpreter's dot is numpy's
    BLAS, whose grouping of a row's products may follow its tile's other rows)."""
    m, k = x_MK.shape
    n = w_KN.shape[1]
    bm, bn, bk = DOT_BLOCKS
    out = torch.empty((m, n), dtype=torch.float32, device=x_MK.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _matmul_dot_kernel[grid](x_MK, w_KN, out, m, n, k, x_MK.stride(0), x_MK.stride(1), w_KN.stride(0),
                             w_KN.stride(1), out.stride(0), out.stride(1), BM=bm, BN=bn, BK=bk,
                             PRECISION="ieee" if x_MK.dtype == torch.float32 else "tf32")
    return out


def rms_norm(x_MD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row in fp32, rounded to x's format, times the weight (HF's order), one order a row."""
    if not available(x_MD):
        return rms_norm_rows(x_MD, weight_D, eps)
    x_MD = x_MD.contiguous()
    out = torch.empty_like(x_MD)
    _rms_norm_kernel[(x_MD.shape[0],)](x_MD, weight_D, out, x_MD.shape[1], x_MD.stride(0), out.stride(0), eps,
                                       BD=BLOCK_D)
    return out


def logsumexp(x_RV: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row, (R,) fp32, one order a row."""
    if not available(x_RV):
        return logsumexp_rows(x_RV)
    x_RV = x_RV.contiguous()
    out = torch.empty(x_RV.shape[0], dtype=torch.float32, device=x_RV.device)
    _logsumexp_kernel[(x_RV.shape[0],)](x_RV, out, x_RV.shape[1], x_RV.stride(0), BV=BLOCK_V)
    return out


# the torch fallback: each row alone, so the library's kernel choice cannot depend on the batch


def matmul_rows(x_MK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    w = w_KN.float()
    return torch.cat([x_MK[i:i + 1].float() @ w for i in range(x_MK.shape[0])]) if x_MK.shape[0] else \
        torch.empty((0, w_KN.shape[1]), device=x_MK.device)


def rms_norm_rows(x_MD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    rows = []
    for i in range(x_MD.shape[0]):
        x32 = x_MD[i:i + 1].float()
        rows.append(weight_D * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x_MD.dtype))
    return torch.cat(rows) if rows else torch.empty_like(x_MD)


def logsumexp_rows(x_RV: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.logsumexp(x_RV[i:i + 1].float(), dim=-1) for i in range(x_RV.shape[0])]) \
        if x_RV.shape[0] else torch.empty(0, device=x_RV.device)
