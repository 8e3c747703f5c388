"""The batch-invariant mode's matmul on a CUDA GPU, in Triton (issues 56 and 57): every output row's sums in one
fixed order whatever the number of rows, so a request's logits do not depend on what it is batched with.

- `matmul_dot(x_MK, w_KN)` (`invariant_matmul` on a GPU): one fixed tiling (DOT_BLOCKS: 64 x 16 tiles, K in slices
  of 64 in ascending order; or the weight's shape's own, DOT_BLOCKS_BY_SHAPE: never the rows'), no split-K, each
  slice's tile product by `tl.dot` on the tensor cores with fp32 sums (fp32 at input_precision "ieee", never TF32),
  compiled once whatever M is. A tile is always whole (masked loads pad it), so a row's products meet the same
  instruction sequence whatever the other rows hold.
- `matmul(x_MK, w_KN)`: the same idea with each slice's products reduced by `tl.sum`: what the interpreter runs
  (its `tl.dot` is numpy's, not row-invariant). On an H100 its fp32 results missed fp32 sums' error bound by TF32's
  margin: Triton's combine pass compiles sum(x[:, :, None] * w[None, :, :], 1) of 16 rows and columns or more as a
  tl.dot at TF32 (found on an H200, in the attention), so the GPU runs `matmul_dot`. It now reduces the last axis
  of x[:, None, :] * w_t[None, :, :], which the pass does not match; not yet timed on a GPU in this form.

Where Triton does not import, or the tensors are on the CPU without TRITON_INTERPRET=1, `matmul` computes the same
reduction with torch, one row at a time (`matmul_rows`).
"""

from __future__ import annotations

import torch

from toolkit.native.invariant_gpu import FIXED, available, tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # the tl.sum matmul's one tiling


def invariant_matmul(x_MK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    """The batch-invariant mode's matmul, (M, N) in x's format: tensor-core tiles on a GPU, the tl.sum tiles in the
    interpreter (whose tile product is numpy's, not row-invariant). A 16-bit result is the fp32 sums rounded in the
    kernel's store, the bits of `.to(x.dtype)` after an fp32 result without its launch and its fp32 copy."""
    fn = matmul_dot if x_MK.is_cuda else matmul
    return fn(x_MK, w_KN, out_dtype=x_MK.dtype)


if triton is not None:
    from toolkit.native.invariant_gpu import rounded  # only where Triton imports

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel whatever the row count (M = 1 included)
    def _matmul_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        M,
        N,
        K,
        sxm,
        sxk,
        swk,
        swn,
        som,
        son,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):  # ascending slices of K: the one order of every row's sum
            kk = k0 + rk
            x = tl.load(
                x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
            ).to(tl.float32)
            w = tl.load(  # (BN, BK): the products reduce the last axis (not a TF32 tl.dot: see the module's notes)
                w_ptr + kk[None, :] * swk + rn[:, None] * swn, mask=(kk[None, :] < K) & (rn[:, None] < N), other=0.0
            ).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        out = rounded(acc, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)  # once, to nearest even
        tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, out, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel whatever the row count (M = 1 included)
    def _matmul_dot_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        M,
        N,
        K,
        sxm,
        sxk,
        swk,
        swn,
        som,
        son,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        PRECISION: tl.constexpr,
        WIDEN: tl.constexpr,
    ):
        """The same fixed tiling, each slice's tile product by `tl.dot` (the tensor cores on a GPU): a row's
        products go through the MMA instruction's own fixed order, the same whatever the tile's other rows hold;
        fp32 at PRECISION "ieee" (never TF32). WIDEN: 16-bit tiles widened to fp32 first (the interpreter's dot
        of bf16 tiles is wrong; a 16-bit product is exact in fp32, so only the sums' order can differ)."""
        rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            x = tl.load(
                x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
            )
            w = tl.load(
                w_ptr + kk[:, None] * swk + rn[None, :] * swn, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0
            )
            if WIDEN:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        out = rounded(acc, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)  # once, to nearest even
        tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, out, mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x_MK: torch.Tensor, w_KN: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x @ w, (M, N), each row's sums in one order whatever M is, in fp32, rounded to `out_dtype` at the end."""
    m, n = x_MK.shape[0], w_KN.shape[1]
    if not available(x_MK):
        return matmul_rows(x_MK, w_KN).to(out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=x_MK.device)
    if m == 0:
        return out
    _launch(_matmul_kernel, x_MK, w_KN, out, (BLOCK_M, BLOCK_N, BLOCK_K))
    return out


# matmul_dot's one tiling of 16-bit inputs (BLOCK_M x BLOCK_N tiles, BLOCK_K slices): 16 columns a program, where 64
# left a decode step's narrow products (N = 2048 of Llama-3.2-1B's o and down: 32 programs) a quarter of an H200's
# 132 multiprocessors (its batch-invariant step at batch 32: 3.66 ms, 4.27 ms in 64 x 64 x 64; batch 1 the same)
DOT_BLOCKS = (64, 16, 64)
DOT_BLOCKS_FP32 = (16, 32, 32)  # ... and of fp32's, whose "ieee" tile product is FMAs, not the tensor cores
# a product's own tiling by its shape (K, N), over the format's: fixed by the weights, never by the rows, so a row's
# sums keep one order whatever it is batched with (`python -m toolkit.bench.gpu --dot-blocks-from` fills them from
# the kernel table's fastest; a run's manifest names them, and a replay under others is refused)
DOT_BLOCKS_BY_SHAPE: dict[tuple[int, int], tuple[int, ...]] = {}
DOT_BLOCKS_BY_SHAPE_FP32: dict[tuple[int, int], tuple[int, ...]] = {}


# tilings the benchmark times beside the format's own (`python -m toolkit.bench.gpu --kernels`, `--dot-blocks`), and
# the interpreter checks: at one row a decode product is bound by the weight bytes a multiprocessor has in flight
# (programs x the K slice's bytes x the pipeline's stages: 64 x 64 x 64 and 64 x 16 x 64 timed alike at batch 1 on an
# H200), so the longer K slices and deeper pipelines are the candidates. A fourth number is the pipeline's stages
# (Triton's num_stages: K slices loaded ahead; its default 3); the stages move loads, never the order of the sums.
# Llama-3.2-1B's o and down products (N = 2048) run 128 programs of 16 columns, about one a multiprocessor: each
# keeps BK x 16 weights a stage in flight (6 KB at 64 x 16 x 64), where an H200's bandwidth asks some 30 KB a
# multiprocessor. Sixteen rows a tile leave the shared memory for the longest slices and deepest pipelines.
CANDIDATES = (
    (64, 64, 64),
    (64, 32, 64),
    (16, 16, 64),
    (64, 16, 128),
    (64, 16, 256),
    (16, 16, 256),
    (16, 32, 256),
    (64, 16, 128, 4),
    (64, 16, 256, 4),
    (16, 16, 256, 4),
    (16, 16, 512),
)
CANDIDATES_FP32 = (
    (16, 16, 32),
    (16, 16, 64),
    (32, 16, 32),
    (16, 64, 32),
    (16, 16, 128),
    (16, 32, 128),
    (16, 32, 128, 4),
)


# ... and those it times again with the weights stored (N, K) (each column's K slice one contiguous run: stored (K, N)
# as the engine keeps them, a 16-bit tile of 16 columns reads 32 bytes a row of its slice); the layout moves loads,
# never the order of the sums, so it keeps every bit (tests/test_invariant_gpu.py)
LAYOUT_CANDIDATES = ((64, 64, 64), (16, 16, 128))
LAYOUT_CANDIDATES_FP32 = ((16, 64, 32),)


def layout_tilings(dtype: torch.dtype, k: int | None = None, n: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The tilings the benchmark times with the weights stored (N, K) (`stored_nk`): the own tiling of the format
    (and of a (K, N) weight where given: `dot_blocks`), then others."""
    return _own_then(dot_blocks(dtype, k, n), LAYOUT_CANDIDATES_FP32 if dtype == torch.float32 else LAYOUT_CANDIDATES)


def candidate_tilings(dtype: torch.dtype, k: int | None = None, n: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The own tiling of the format (and of a (K, N) weight where given), then the others the benchmark compares."""
    return _own_then(dot_blocks(dtype, k, n), CANDIDATES_FP32 if dtype == torch.float32 else CANDIDATES)


def _own_then(own: tuple[int, ...], others: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    return (own,) + tuple(b for b in others if b != own)


def stored_nk(w_KN: torch.Tensor) -> torch.Tensor:
    """The same (K, N) values stored (N, K), as torch's Linear keeps them: each column's K one contiguous run."""
    return w_KN.t().contiguous().t()


def store_weights_nk(model) -> None:
    """Every projection of `model` (a PagedDecoder) and its LM head stored (N, K), still seen as (K, N): the same
    values, so the invariant matmul gives every product its bits (its loads follow the weight's strides; the sums'
    order is the tiling's). For `python -m toolkit.bench.gpu --weights-nk` to time the order in the engine, before a
    GPU model keeps its weights so. Call it before an engine is made: a captured graph reads the weights it saw."""
    for layer in model.layers:
        for name in layer.projections:
            setattr(layer, name, torch.nn.Parameter(stored_nk(getattr(layer, name)), requires_grad=False))
    model.lm_head_t = torch.nn.Parameter(stored_nk(model.lm_head_t), requires_grad=False)


def dot_blocks(dtype: torch.dtype, k: int | None = None, n: int | None = None) -> tuple[int, ...]:
    """matmul_dot's tiling for inputs of `dtype`, of a (K, N) weight where given: fixed by the format and the
    weight's shape, never by the number of rows."""
    own, by_shape = _tilings(dtype)
    return by_shape.get((k, n)) or own


def describe_tiling(dtype: torch.dtype) -> str:
    """The tilings of `dtype`'s products, as a manifest names them: the format's, then each shape's own."""
    own, by_shape = _tilings(dtype)
    return "; ".join([tiling_name(own)] + [f"{k}x{n}: {tiling_name(b)}" for (k, n), b in sorted(by_shape.items())])


def tiling_name(blocks: tuple[int, ...]) -> str:
    """BMxBNxBK (then xstages): how the benchmark, the manifest and the notes write a tiling."""
    return "x".join(map(str, blocks))


def _tilings(dtype: torch.dtype) -> tuple[tuple[int, ...], dict[tuple[int, int], tuple[int, ...]]]:
    """The format's tiling and its table by shape."""
    if dtype == torch.float32:
        return DOT_BLOCKS_FP32, DOT_BLOCKS_BY_SHAPE_FP32
    return DOT_BLOCKS, DOT_BLOCKS_BY_SHAPE


def matmul_dot(
    x_MK: torch.Tensor,
    w_KN: torch.Tensor,
    blocks: tuple[int, ...] | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x @ w by tile products in one fixed tiling, no split-K, fp32 sums: the matmul the engine's batch-invariant
    mode runs on a CUDA GPU. Tiles are always whole (masked loads pad them), so the tile product has one shape
    whatever M is, and a row's products are summed the same way whatever the other rows hold. `blocks` overrides
    the tiling of the format and the weight's shape (`dot_blocks`: BM, BN, BK and optionally the pipeline's
    stages) for the benchmark's comparison of tilings; the engine never passes it. The fp32 sums are rounded once
    to `out_dtype` as they are stored."""
    m, k = x_MK.shape
    n = w_KN.shape[1]
    bm, bn, bk, *stages = blocks or dot_blocks(x_MK.dtype, k, n)
    pipeline = {"num_stages": stages[0]} if stages else {}
    widen = x_MK.device.type == "cpu"  # the interpreter
    out = torch.empty((m, n), dtype=out_dtype, device=x_MK.device)
    if m == 0:
        return out
    _launch(
        _matmul_dot_kernel,
        x_MK,
        w_KN,
        out,
        (bm, bn, bk),
        PRECISION="ieee" if widen or x_MK.dtype == torch.float32 else "tf32",
        WIDEN=widen,
        **pipeline,
    )
    return out


def _launch(
    kernel, x_MK: torch.Tensor, w_KN: torch.Tensor, out: torch.Tensor, blocks: tuple[int, int, int], **meta
) -> None:
    """One launch of a matmul kernel over (BM, BN) tiles of `out`: the shapes, then each operand's two strides."""
    (m, k), n, (bm, bn, bk) = x_MK.shape, w_KN.shape[1], blocks
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    kernel[grid](
        x_MK, w_KN, out, m, n, k, *x_MK.stride(), *w_KN.stride(), *out.stride(), BM=bm, BN=bn, BK=bk, **FIXED, **meta
    )


def matmul_rows(x_MK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    w = w_KN.float()
    return (
        torch.cat([x_MK[i : i + 1].float() @ w for i in range(x_MK.shape[0])])
        if x_MK.shape[0]
        else torch.empty((0, w_KN.shape[1]), device=x_MK.device)
    )
