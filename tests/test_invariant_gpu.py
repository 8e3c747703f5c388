"""The batch-invariant GPU kernels (toolkit/native/invariant_gpu.py) run here under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 where torch sees no GPU): every row is the same bits whatever batch it is
in, and the float64 result within the format's rounding; the torch fallback keeps the same promises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.families import checkpoint_dir
from toolkit.config import ModelConfig
from toolkit.engine.scheduler import ScheduledChunk
from toolkit.kv.attention import write_kv
from toolkit.models import load_model
from toolkit.native import gpu_attention as ga
from toolkit.native import gpu_matmul as gm
from toolkit.native import invariant_gpu as ig

TRITON = pytest.mark.skipif(
    not ig.available(torch.empty(0)),
    reason="Triton does not import here, or runs neither a GPU nor its interpreter "
    "(TRITON_INTERPRET=1): the torch fallback is tested instead",
)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def _subsets(draw, m: int) -> list[list[int]]:
    """Other batches that hold some of the m rows: alone, a slice, a shuffled subset."""
    rows = draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=min(m, 9), unique=True))
    return [[rows[0]], rows, sorted(rows)]


def _matmul_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x @ w - exact| for fp32 sums of k products: k * 2^-24 * (|x| @ |w|), and a little."""
    return (x.shape[1] + 2) * 2.0**-24 * (x.double().abs() @ w.double().abs()) + 1e-30


@pytest.mark.parametrize(
    "impl", [pytest.param(gm.matmul, marks=TRITON, id="triton"), pytest.param(gm.matmul_rows, id="torch-rows")]
)
@settings(max_examples=12, deadline=None)
@given(data=st.data(), m=st.integers(1, 40), k=st.integers(1, 80), n=st.integers(1, 70), dtype=DTYPES)
def test_matmul_rows_are_the_same_bits_in_any_batch(impl, data, m, k, n, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(k, n, generator=gen).to(dtype)
    full = impl(x, w)
    assert full.dtype == torch.float32 and full.shape == (m, n)
    assert ((full.double() - x.double() @ w.double()).abs() <= _matmul_bound(x, w)).all()
    for rows in _subsets(data.draw, m):
        index = torch.tensor(rows)
        assert torch.equal(impl(x[index], w), full[index]), rows


@TRITON
@settings(max_examples=12, deadline=None)
@given(data=st.data(), m=st.integers(1, 70), k=st.integers(1, 300), n=st.integers(1, 70), dtype=DTYPES)
def test_the_tensor_core_matmul_is_within_fp32_sums_rounding(data, m, k, n, dtype):
    """matmul_dot, what the batch-invariant mode runs on a GPU, in its format's tiling and in each the benchmark
    compares (gpu_matmul.candidate_tilings): float64's product within fp32 sums' rounding. Its rows' invariance is
    a GPU property (tests/test_cuda.py): the interpreter's tile product is numpy's, whose summation in a tile may
    follow the tile's other rows."""
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
    got = gm.matmul_dot(x, w, data.draw(st.sampled_from(gm.candidate_tilings(dtype))))
    assert got.dtype == torch.float32 and ((got.double() - x.double() @ w.double()).abs() <= _matmul_bound(x, w)).all()


@TRITON
@settings(max_examples=6, deadline=None)
@given(
    m=st.integers(1, 20),
    k=st.integers(1, 300),
    n=st.integers(1, 40),
    dtype=DTYPES,
    scale=st.sampled_from([1.0, 2.0**-8, 300.0]),
)
def test_a_16_bit_result_is_rounded_in_the_store_as_torch_rounds_it(m, k, n, dtype, scale):
    """The engine's invariant matmul returns x's format from the kernel's store (no separate cast a projection):
    the fp32 sums rounded to nearest even, bit for bit what `.to(dtype)` of the fp32 result gives, in both kernels
    and each tiling the benchmark compares. Ties included: sums of a few bf16 products land on half-way points of
    bf16 often."""
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    x = (torch.randint(-8, 9, (m, k), generator=gen) * scale).to(dtype)  # small integers: exact sums, many ties
    w = torch.randn(k, n, generator=gen).to(dtype)
    pairs = [(gm.matmul(x, w), gm.matmul(x, w, out_dtype=dtype))]
    pairs += [(gm.matmul_dot(x, w, b), gm.matmul_dot(x, w, b, out_dtype=dtype)) for b in gm.candidate_tilings(dtype)]
    for fp32, rounded in pairs:
        assert rounded.dtype == dtype and torch.equal(rounded, fp32.to(dtype))
    assert torch.equal(gm.invariant_matmul(x, w), gm.matmul(x, w).to(dtype))


@TRITON
@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 20), k=st.integers(1, 200), n=st.integers(1, 60), dtype=DTYPES)
def test_the_weights_storage_order_keeps_every_bit(m, k, n, dtype):
    """The weights stored (N, K), as the benchmark times them beside the engine's (K, N) (gpu_matmul.layout_tilings):
    the same values in another memory order give both kernels' results bit for bit, in every tiling it times. A
    kernel that read the weights by the (K, N) order's strides whatever the tensor's would fail it."""
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
    w_nk = gm.stored_nk(w)
    assert torch.equal(w_nk, w) and (min(k, n) == 1 or w_nk.stride() == (1, k))  # (one row or column: either order)
    assert torch.equal(gm.matmul(x, w_nk), gm.matmul(x, w))
    for b in set(gm.layout_tilings(dtype)) | set(gm.candidate_tilings(dtype)[:2]):
        assert torch.equal(gm.matmul_dot(x, w_nk, b, out_dtype=dtype), gm.matmul_dot(x, w, b, out_dtype=dtype)), b


@TRITON
def test_a_products_own_tiling_is_taken_by_its_shape_and_never_by_its_rows(monkeypatch):
    """gpu_matmul.DOT_BLOCKS_BY_SHAPE (what `--dot-blocks-from` fills from the kernel table): a (K, N) weight named
    there is multiplied in its own tiling at every number of rows, other shapes in the format's, and the manifest's
    description names it. fp32 in the interpreter, where tilings' sums differ (numpy's tile product), so a table
    that is not read, or read for the wrong shape, is seen."""
    gen = torch.Generator().manual_seed(5)
    x, w, w2 = (
        torch.randn(9, 128, generator=gen),
        torch.randn(128, 40, generator=gen),
        torch.randn(128, 24, generator=gen),
    )
    own = gm.dot_blocks(torch.float32)
    by_own = gm.matmul_dot(x, w, own)
    other = next(b for b in gm.candidate_tilings(torch.float32) if not torch.equal(gm.matmul_dot(x, w, b), by_own))
    monkeypatch.setattr(gm, "DOT_BLOCKS_BY_SHAPE_FP32", {(128, 40): other})
    assert gm.dot_blocks(torch.float32, 128, 40) == other and gm.dot_blocks(torch.bfloat16, 128, 40) == gm.DOT_BLOCKS
    by_other = gm.matmul_dot(x, w, other)
    assert torch.equal(gm.matmul_dot(x, w), by_other)
    for m in (1, 4, 9):
        assert torch.equal(gm.matmul_dot(x[:m], w), by_other[:m]), m
    assert torch.equal(gm.matmul_dot(x, w2), gm.matmul_dot(x, w2, own))
    assert gm.describe_tiling(torch.float32) == f"{'x'.join(map(str, own))}; 128x40: {'x'.join(map(str, other))}"
    assert gm.describe_tiling(torch.bfloat16) == "x".join(map(str, gm.DOT_BLOCKS))


if ig.triton is not None:
    tl = ig.tl

    @ig.triton.jit
    def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        y = tl.load(x_ptr + i, mask=i < n, other=0.0)
        tl.store(out_ptr + i, ig.rounded(y, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=i < n)


# fp32 bit patterns where rounding to 16 bits goes wrong first: NaNs (a GPU's is 0x7FFFFFFF, whose rounding carry
# overflows into the sign), infinities, the largest finite value (rounds to inf), ties to even both ways (at the
# smallest normal too), -0.0, subnormals rounding to 0 or to the smallest normal. (Not a result that is a bf16
# subnormal, below 2^-126: the interpreter's conversion flushes it to 0, where a GPU's and torch's keep it.)
SPECIAL_BITS = [
    0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F7FFF, 0x477FEFFF,
    0x477FF000, 0x3F808000, 0x3F818000, 0xBF808000, 0x80000000, 0x00000000, 0x00000001, 0x00008000, 0x00808000,
    0x00818000, 0x807FFFFF, 0x33800000, 0x33000001,
]  # fmt: skip


@TRITON
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy's fp16 of 3e38: inf, meant
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_rounding_is_torchs_at_nans_infinities_ties_and_subnormals(dtype):
    """`rounded` (every invariant kernel's fp32 -> 16-bit rounding, the matmul's store included): torch's `.to(dtype)`
    bit for bit, and a NaN stays a NaN (not -0.0 from the carry of a GPU's 0x7FFFFFFF NaN, nor inf)."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in SPECIAL_BITS], dtype=torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(200, generator=gen) * 10.0 ** torch.randint(-8, 8, (200,))])
    out = torch.empty(x.shape, dtype=dtype)
    _round_kernel[(1,)](x, out, x.numel(), BLOCK=256)
    want = x.to(dtype)
    assert torch.equal(out.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(out[finite].view(torch.int16), want[finite].view(torch.int16))


@pytest.mark.parametrize(
    "impl", [pytest.param(ig.rms_norm, marks=TRITON, id="triton"), pytest.param(ig.rms_norm_rows, id="torch-rows")]
)
@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    m=st.integers(1, 20),
    d=st.sampled_from([1, 7, 64, 255, 256, 576, 700]),
    dtype=DTYPES,
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
)
def test_rms_norm_rows_are_hfs_expression_in_any_batch(impl, data, m, d, dtype, scale):
    """Each row the same bits alone or batched; fp32 rows within 2e-6 of float64 and 16-bit rows HF's expression
    bit for bit (a row's sum of squares in another order changes its fp32 norm in the last bit, which rounding
    to 16 bits almost always hides: so the 16-bit comparison is with the one-row torch expression)."""
    gen = torch.Generator().manual_seed(m * 1000 + d)
    x = (torch.randn(m, d, generator=gen) * scale).to(dtype)
    w = torch.randn(d, generator=gen).to(dtype)
    full = impl(x, w, 1e-5)
    assert full.dtype == dtype
    x64 = x.double()
    want = w.double() * (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5))
    if dtype == torch.float32:
        assert ((full.double() - want).abs() <= 2e-6 * want.abs() + 1e-30).all()
    else:
        assert (full != ig.rms_norm_rows(x, w, 1e-5)).float().mean() < 0.01
    for rows in _subsets(data.draw, m):
        index = torch.tensor(rows)
        assert torch.equal(impl(x[index], w, 1e-5), full[index]), rows


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # the interpreter's log(0)
@pytest.mark.parametrize(
    "impl", [pytest.param(ig.logsumexp, marks=TRITON, id="triton"), pytest.param(ig.logsumexp_rows, id="torch-rows")]
)
@settings(max_examples=12, deadline=None)
@given(data=st.data(), r=st.integers(1, 12), v=st.sampled_from([1, 3, 1000, 1024, 1025, 5000]), masked=st.booleans())
def test_logsumexp_rows_in_any_batch(impl, data, r, v, masked):
    gen = torch.Generator().manual_seed(r * 10 + v)
    x = torch.randn(r, v, generator=gen) * 6
    if masked:
        x[0] = float("-inf")
    full = impl(x)
    want = torch.logsumexp(x.double(), dim=-1)
    finite = torch.isfinite(want)
    assert (full[~finite] == float("-inf")).all()
    assert ((full.double() - want).abs()[finite] <= 2e-6 * want.abs()[finite] + 1e-6).all()
    for rows in _subsets(data.draw, r):
        index = torch.tensor(rows)
        assert torch.equal(impl(x[index]), full[index]), rows


@TRITON
def test_a_tiling_chosen_by_the_row_count_is_caught():
    """What the matmul test guards against: K sliced otherwise for a larger batch (a split chosen by the row
    count) changes a row's bits, so its comparison of a row alone and batched would fail."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(24, 200, generator=gen), torch.randn(200, 40, generator=gen)
    alone = gm.matmul(x[:1], w)
    try:
        gm.BLOCK_K = 16  # what a row-count-dependent choice would give the batch
        batched = gm.matmul(x, w)
    finally:
        gm.BLOCK_K = 32
    assert not torch.equal(batched[:1], alone)
    assert torch.equal(gm.matmul(x, w)[:1], alone)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many of the format's units in the last place a and b are apart (same-sign finite values)."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return (a.view(bits).long() - b.view(bits).long()).abs()


@TRITON
@settings(max_examples=10, deadline=None)
@given(data=st.data(), n=st.integers(1, 9), d=st.sampled_from([1, 8, 96, 576]), dtype=DTYPES, residual=st.booleans())
def test_the_add_rms_norm_kernel_is_the_torch_path_bit_for_bit(data, n, d, dtype, residual):
    """The GPU's fused residual add + RMSNorm: the sum is torch's `x + r` and the norm toolkit.models.decoder's
    rms_norm of it, bit for bit (rms_norm is HF's order), and a row's bits alone are its bits in the batch."""
    from toolkit.models.decoder import rms_norm

    gen = torch.Generator().manual_seed(n * 100 + d)
    x, r = (torch.randn(2, n, d, generator=gen) * 3).to(dtype)
    w = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    total, normed = ig.add_rms_norm(x, r if residual else None, w, 1e-5)
    want = x + r if residual else x
    assert torch.equal(total, want)
    reference = rms_norm(want, w, 1e-5)
    if dtype == torch.float32:  # the sum of squares in another order: within a few fp32 ulps
        assert (_ulps(normed, reference)[reference != 0] <= 4).all()
    else:
        assert (_ulps(normed, reference) <= 1).all() and (normed != reference).float().mean() < 0.05
    for rows in _subsets(data.draw, n):
        index = torch.tensor(rows)
        assert torch.equal(ig.add_rms_norm(x[index], r[index] if residual else None, w, 1e-5)[1], normed[index])


@TRITON
@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 6), heads=st.integers(1, 7), dim=st.sampled_from([2, 6, 16, 24, 64]), dtype=DTYPES)
def test_the_rope_kernel_is_torchs_expression_bit_for_bit(n, heads, dim, dtype):
    """RoPE of a strided q | k view in one kernel: x * cos + rotate_half(x) * sin in x's format, each op rounded as
    torch's, the same bits; a head_dim that is no power of two too (its tile's rest masked)."""
    from toolkit.models.decoder import rotate_half

    gen = torch.Generator().manual_seed(n * 10 + heads)
    fused = torch.randn(n, (heads + 1) * dim, generator=gen).to(dtype) * 4
    x = fused[:, : heads * dim].view(n, heads, dim)  # a view with the row stride of the wider projection
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(300).float()[:, None] * inv[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    positions = torch.randint(0, 300, (n,), generator=gen)
    c, s = cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)
    assert torch.equal(ig.rope(x, cos, sin, positions), x * c + rotate_half(x) * s)


@TRITON
@settings(max_examples=10, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 5]),
    dim=st.sampled_from([4, 6, 16]),
    dtype=DTYPES,
    cache_dtype=st.sampled_from([None, torch.bfloat16, torch.float32]),
)
def test_rope_with_the_cache_writes_is_rope_then_write_kv_bit_for_bit(
    data, n, kv_heads, groups, dim, dtype, cache_dtype
):
    """RoPE and the step's cache writes in one kernel: q's heads are the RoPE kernel's bits, and every cache slot
    holds what RoPE then write_kv (torch's index copies, rounded to the cache's format) leaves there: the step's
    slots its keys and values, every other slot untouched. The q | k heads and v are strided views of one fused
    projection, as in the decoder."""
    heads = kv_heads * groups
    gen = torch.Generator().manual_seed(n * 100 + heads * 10 + dim)
    positions = torch.randint(0, 64, (n,), generator=gen)
    slots = torch.tensor(data.draw(st.permutations(range(20)))[:n])
    rope_write_kv_checked(gen, heads, kv_heads, dim, dtype, cache_dtype, positions, slots, blocks=5, block=4)


def rope_write_kv_checked(gen, heads, kv_heads, dim, dtype, cache_dtype, positions, slots, blocks, block):
    """RoPE with the cache writes (invariant_gpu.rope_write_kv) of a strided q | k | v projection, checked against
    RoPE then write_kv bit for bit, on the positions' and slots' device: (q's heads, the key and value caches)."""
    n, device = len(positions), positions.device
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(dtype).to(device)
    qk = qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(int(positions.max()) + 1).float()[:, None] * inv[None, :]
    cos, sin = (torch.cat((angles, angles), -1).cos().to(device), torch.cat((angles, angles), -1).sin().to(device))
    k_cache, v_cache = torch.randn(2, blocks, block, kv_heads, dim, generator=gen).to(cache_dtype or dtype).to(device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    roped = ig.rope(qk, cos, sin, positions)
    write_kv(want_k, want_v, roped[:, heads:], v, slots)
    q = ig.rope_write_kv(qk, v, cos, sin, positions, k_cache, v_cache, slots)
    assert torch.equal(q, roped[:, :heads])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    return q, k_cache, v_cache


@TRITON
@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 5), width=st.sampled_from([1, 40, 1030]), dtype=DTYPES)
def test_the_silu_mul_kernel_is_torchs_within_a_few_ulps(n, width, dtype):
    """silu(gate) * up in one kernel: torch's two ops within a few fp32 units in the last place (its exp is the
    device's own), and in a 16-bit format within one unit and nearly always the same bits."""
    gen = torch.Generator().manual_seed(n + width)
    gate_up = (torch.randn(n, 2 * width, generator=gen) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = ig.silu_mul(gate_up)
    same_sign = (got.sign() == want.sign()) | (want == 0)
    assert same_sign.all() and (_ulps(got, want)[want != 0] <= (4 if dtype == torch.float32 else 1)).all()
    assert dtype == torch.float32 or (got != want).float().mean() < 0.05


def _attention_reference(q, k_cache, v_cache, tables, query_table, query_ctx, scale):
    """float64 softmax(q k^T) v of each token over its own sequence's first ctx keys."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    groups = heads // kv_heads
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    for i in range(n):
        ctx, blocks = int(query_ctx[i]), tables[query_table[i]]
        keys = k_cache[blocks].reshape(-1, kv_heads, dim)[:ctx].double()
        values = v_cache[blocks].reshape(-1, kv_heads, dim)[:ctx].double()
        for h in range(heads):
            weights = torch.softmax(keys[:, h // groups] @ q[i, h].double() * scale, 0)
            out[i, h] = weights @ values[:, h // groups]
    return out


def _attention_case(data, seed: int, kv_heads: int, groups: int, block: int, dim: int, dtype, width: int, max_n: int):
    """Three sequences' cached keys in shuffled blocks of `width` each, and 1..max_n query tokens, each over one of
    them with a drawn context: (q, k_cache, v_cache, tables, query_table, query_ctx)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = 3
    num_blocks = seqs * width + 1
    k_cache, v_cache = (torch.randn(2, num_blocks, block, kv_heads, dim, generator=gen) * 2).to(dtype)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: seqs * width].view(seqs, width)
    n = data.draw(st.integers(1, max_n))
    query_table = torch.tensor(data.draw(st.lists(st.integers(0, seqs - 1), min_size=n, max_size=n)))
    query_ctx = torch.tensor(data.draw(st.lists(st.integers(1, width * block), min_size=n, max_size=n)))
    q = torch.randn(n, kv_heads * groups, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, query_table, query_ctx


def _attention_tolerance(dtype, want: torch.Tensor) -> float:
    """fp32 sums' error, or the 16-bit output's rounding of the largest value."""
    return 1e-5 if dtype == torch.float32 else 2**-7 * want.abs().max().item() + 1e-3


@TRITON
@settings(max_examples=8, deadline=None)
@given(
    data=st.data(),
    kv_heads=st.integers(1, 3),
    groups=st.sampled_from([1, 3, 4, 20]),
    block=st.sampled_from([1, 3, 8]),
    dim=st.sampled_from([8, 12, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_the_paged_attention_kernel_gives_a_token_its_bits_in_any_mix(data, kv_heads, groups, block, dim, dtype):
    """The GPU's paged attention (one program per token and KV head, or per 16 of its query heads, keys in the
    table's order; a head_dim of no power of two in a wider tile, masked): within the format's rounding of float64,
    and each token's output the same bits alone as in any batch, a prompt chunk's tokens (one sequence, growing
    contexts) mixed with other sequences' decode tokens."""
    seed = kv_heads * 100 + groups * 10 + block
    q, k_cache, v_cache, tables, query_table, query_ctx = _attention_case(
        data, seed, kv_heads, groups, block, dim, dtype, width=5, max_n=8
    )
    n = q.shape[0]
    out = torch.empty_like(q)
    ga.paged_attention(q, k_cache, v_cache, tables, query_table, query_ctx, dim**-0.5, out)
    want = _attention_reference(q, k_cache, v_cache, tables, query_table, query_ctx, dim**-0.5)
    assert (out.double() - want).abs().max() <= _attention_tolerance(dtype, want)
    for rows in _subsets(data.draw, n):
        index = torch.tensor(rows)
        alone = torch.empty_like(q[index])
        ga.paged_attention(q[index], k_cache, v_cache, tables, query_table[index], query_ctx[index], dim**-0.5, alone)
        assert torch.equal(alone, out[index]), rows


@TRITON
@settings(max_examples=8, deadline=None)
@given(
    data=st.data(),
    kv_format=st.sampled_from(["int8", "fp8_e4m3"]),
    per_block=st.booleans(),
    groups=st.sampled_from([1, 3, 20]),
    split=st.sampled_from([16, 256]),
    dim=st.sampled_from([8, 12]),
)
def test_an_8_bit_caches_attention_is_its_de_quantised_cache_and_a_tokens_bits_in_any_mix(
    data, kv_format, per_block, groups, split, dim
):
    """The attention over an int8 / fp8 cache with a scale per block and KV head, or per KV head: the float64
    attention over the cache de-quantised (units x scale) within fp32 sums' rounding, split or not, and each token's
    output the same bits alone as in any batch."""
    from toolkit.kv.quant import FORMATS, quantize

    q, k, v, tables, query_table, query_ctx = _attention_case(
        data, groups * 10 + dim, 2, groups, 4, dim, torch.float32, width=6, max_n=6
    )
    q_max = FORMATS[kv_format][1]
    axes = (1, 3) if per_block else (0, 1, 3)
    k_scales, v_scales = (x.abs().amax(dim=axes) / q_max for x in (k, v))
    shape = (-1, 1, 2, 1) if per_block else (1, 1, 2, 1)
    k8, v8 = (quantize(x, s.view(shape), kv_format) for x, s in ((k, k_scales), (v, v_scales)))
    k_dq, v_dq = (x8.float() * s.view(shape) for x8, s in ((k8, k_scales), (v8, v_scales)))
    out = torch.empty_like(q)
    args = (tables, query_table, query_ctx, dim**-0.5)
    ga.paged_attention(q, k8, v8, *args, out, split, k_scales=k_scales, v_scales=v_scales)
    want = _attention_reference(q, k_dq, v_dq, *args)
    assert (out.double() - want).abs().max() <= 1e-5
    for rows in _subsets(data.draw, q.shape[0]):
        index = torch.tensor(rows)
        alone = torch.empty_like(q[index])
        ga.paged_attention(
            q[index],
            k8,
            v8,
            tables,
            query_table[index],
            query_ctx[index],
            dim**-0.5,
            alone,
            split,
            k_scales=k_scales,
            v_scales=v_scales,
        )
        assert torch.equal(alone, out[index]), rows


@TRITON
@settings(max_examples=8, deadline=None)
@given(
    data=st.data(),
    kv_heads=st.integers(1, 2),
    groups=st.sampled_from([1, 3, 18]),
    block=st.sampled_from([1, 4, 8]),
    split=st.sampled_from([16, 32]),
    dim=st.sampled_from([12, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_a_long_contexts_splits_keep_a_tokens_bits_in_any_mix(data, kv_heads, groups, block, split, dim, dtype):
    """A context longer than the split is taken a split per program and combined in order (split small here, 256 in
    the engine): within the format's rounding of float64; each token the same bits alone, in any batch and whatever
    the tables' width (the splits allocated: a graph bucket's); and a context of one split the unsplit kernel's bits
    (so which path a batch takes changes no row)."""
    seqs, width = 3, -(-96 // block)
    q, k_cache, v_cache, tables, query_table, query_ctx = _attention_case(
        data, kv_heads * 100 + groups * 10 + block + split, kv_heads, groups, block, dim, dtype, width, max_n=6
    )
    n = q.shape[0]

    def attend(index, tables_SB=tables, split_at=split):
        out = torch.empty_like(q[index])
        ga.paged_attention(
            q[index], k_cache, v_cache, tables_SB, query_table[index], query_ctx[index], dim**-0.5, out, split_at
        )
        return out

    everything = torch.arange(n)
    out = attend(everything)
    want = _attention_reference(q, k_cache, v_cache, tables, query_table, query_ctx, dim**-0.5)
    tolerance = _attention_tolerance(dtype, want)
    assert (out.double() - want).abs().max() <= tolerance
    wider = torch.cat([tables, torch.zeros(seqs, 2 * split // block + 1, dtype=tables.dtype)], 1)
    assert torch.equal(attend(everything, wider), out)  # more splits allocated, none of them read
    kept = ga.ATTENTION_SPLIT_BYTES
    ga.ATTENTION_SPLIT_BYTES = 1  # a token at a time through the partial results (a long prefill chunk's pieces)
    try:
        assert torch.equal(attend(everything), out)
    finally:
        ga.ATTENTION_SPLIT_BYTES = kept
    for rows in _subsets(data.draw, n):
        assert torch.equal(attend(torch.tensor(rows)), out[rows]), rows
    short = query_ctx <= split
    unsplit = attend(everything, split_at=16 * -(-width * block // 16))
    assert torch.equal(unsplit[short], out[short])
    if (~short).any():  # longer ones are combined from the splits: other bits than one pass, within rounding
        assert (unsplit.double() - want).abs().max() <= tolerance


@TRITON
@pytest.mark.parametrize("dim,split", [(6, 256), (12, 256), (12, 16)])
def test_a_heads_masked_tile_reads_nothing_past_the_head(dim, split):
    """A head_dim of no power of two runs in a wider tile: the lanes past the head must read nothing, since there
    the cache holds the next head's or the next slot's values, which may be anything (here NaN: every slot but the
    context's). The output is float64's within fp32 sums' error, and finite."""
    gen = torch.Generator().manual_seed(dim)
    k_cache, v_cache = torch.full((2, 4, 8, 1, dim), float("nan"))
    ctx = 29  # the last seen key is followed by NaN in its block
    keys, values = torch.randn(2, ctx, dim, generator=gen)
    for cache, cached in ((k_cache, keys), (v_cache, values)):
        cache.view(32, 1, dim)[:ctx, 0] = cached
    q = torch.randn(1, 2, dim, generator=gen)
    tables, one, context = torch.arange(4).view(1, 4), torch.tensor([0]), torch.tensor([ctx])
    out = torch.empty_like(q)
    ga.paged_attention(q, k_cache, v_cache, tables, one, context, dim**-0.5, out, split)
    want = _attention_reference(q, k_cache, v_cache, tables, one, context, dim**-0.5)
    assert torch.isfinite(out).all() and (out.double() - want).abs().max() <= 1e-5


@TRITON
def test_a_split_chosen_by_the_batch_would_change_the_bits():
    """What the invariance tests guard against: the same context split at 16 or at 32 keys gives other bits, so a
    split size (or a split count) chosen by the batch's shape would change a token's bits with its batch."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 12, 8, 1, 16, generator=gen)
    q, one, ctx = torch.randn(1, 2, 16, generator=gen), torch.tensor([0]), torch.tensor([90])
    outs = []
    for split in (16, 32):
        out = torch.empty_like(q)
        ga.paged_attention(q, k_cache, v_cache, torch.arange(12).view(1, 12), one, ctx, 0.25, out, split)
        outs.append(out)
    assert not torch.equal(outs[0], outs[1]) and (outs[0] - outs[1]).abs().max() < 1e-5
    with pytest.raises(ValueError, match="multiple of 16"):
        ga.paged_attention(q, k_cache, v_cache, torch.arange(12).view(1, 12), one, ctx, 0.25, outs[0], 24)


@TRITON
def test_the_attention_keeps_its_bits_whatever_the_block_size_and_a_split_chosen_otherwise_is_caught(monkeypatch):
    """The same keys cached in blocks of 8, 4 or 1 give a token the same bits (the kernel takes key positions in
    tiles of its own; the recompute that verify runs need not share the engine's block size). What the batch tests
    guard against: keys taken in other tiles (a KV split chosen by the batch) change the bits."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 9, 8, 1, 16, generator=gen)
    q, one, ctx = torch.randn(1, 2, 16, generator=gen), torch.tensor([0]), torch.tensor([61])
    outs = []
    for block in (8, 4, 1):
        out = torch.empty_like(q)
        ga.paged_attention(
            q,
            k_cache.view(-1, block, 1, 16),
            v_cache.view(-1, block, 1, 16),
            torch.arange(72 // block).view(1, -1),
            one,
            ctx,
            0.25,
            out,
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    monkeypatch.setattr(ga, "ATTENTION_TILE", 8)
    split = torch.empty_like(q)
    ga.paged_attention(q, k_cache, v_cache, torch.arange(8).view(1, 8), one, ctx, 0.25, split)
    assert not torch.equal(split, outs[0])
    assert (split - outs[0]).abs().max() < 1e-5


TINY = dict(
    name="tiny", seed=1, vocab_size=96, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96
)
# 20 query heads over one KV head (two programs a KV head) of head_dim 6 (in tiles of 8): the shapes that need the
# kernels' masks
WIDE = dict(TINY, seed=2, hidden_size=120, num_heads=20, num_kv_heads=1)


def _runs(
    model, batches, backend: str, invariant: bool, kv: tuple[str, str] = ("auto", "block")
) -> dict[tuple[str, int], torch.Tensor]:
    """Run the batches in order over one fresh cache (block size 4; `kv`: its format and scales' granularity, a
    tensor scale of 0.05 every KV head); each sampled row's fp32 logits by (sequence, the position it predicts)."""
    from toolkit.engine.runner import ModelRunner
    from toolkit.engine.scheduler import ScheduledBatch
    from toolkit.kv.paged_cache import PagedKVCache

    layers, kv_heads, head_dim = model.kv_shape
    cache = PagedKVCache(layers, 12, 4, kv_heads, head_dim, model.embed.dtype, "cpu", kv_dtype=kv[0], granularity=kv[1])
    for scales in cache.tensor_scales if cache.granularity == "tensor" else ():
        for scale in scales:
            scale.fill_(0.05)
    runner = ModelRunner(model, cache, torch.device("cpu"), backend, batch_invariant=invariant)
    rows = {}
    for step, chunks in enumerate(batches):
        out = runner.run(
            ScheduledBatch(
                step=step,
                chunks=tuple(chunks),
                num_decode_tokens=0,
                num_prefill_tokens=sum(c.num_tokens for c in chunks),
            )
        )
        row = 0
        for chunk in out.sample_chunks:
            for i in range(chunk.num_logits):
                rows[chunk.seq_id, chunk.start_pos + chunk.num_tokens - chunk.num_logits + i + 1] = out.logits_RV[
                    row + i
                ]
            row += chunk.num_logits
    return rows


# The engine's GPU path in the interpreter: each test below sets TOOLKIT_NATIVE=0 itself, so that the GPU path's
# kernels run instead of the native CPU ones. It takes the same path whatever the switch, so it is not marked
# `native` and make test-fallback does not run it again (tests/conftest.py counts only "switched on" answers).
@TRITON
@pytest.mark.parametrize("dtype,shape", [("float32", TINY), ("bfloat16", TINY), ("float32", WIDE), ("bfloat16", WIDE)])
def test_the_engines_gpu_path_runs_in_the_interpreter_and_keeps_a_rows_bits_in_any_mix(monkeypatch, dtype, shape):
    """The engine's forward as it runs on a CUDA GPU (invariant_gpu.routes widened to the interpreter): Triton's
    attention, residual add + RMSNorm, RoPE and SiLU * up give torch's CPU path's logits within the format's
    rounding; and in the batch-invariant mode (the fixed-tiling matmul too) a sequence's rows are the same bits
    computed alone in one prefill as chunked beside other sequences' prompt chunks and decode tokens. Also for a
    head_dim of no power of two and more query heads a KV head than one program takes."""
    from toolkit.config import ModelConfig
    from toolkit.engine.scheduler import ScheduledChunk as Chunk
    from toolkit.models import load_model

    monkeypatch.setenv("TOOLKIT_NATIVE", "0")
    model = load_model(ModelConfig(**shape, dtype=dtype)).model
    target = tuple((11 * j + 4) % 96 for j in range(14))
    other, third = tuple((5 * j + 1) % 96 for j in range(10)), tuple((3 * j + 2) % 96 for j in range(5))
    alone = [[Chunk("t", target, 0, (0, 1, 2, 3), samples=True, num_logits=14)]]
    mixed = [
        [Chunk("o", other[:9], 0, (4, 5, 6), samples=True), Chunk("t", target[:10], 0, (0, 1, 2), True)],
        [
            Chunk("o", other[9:], 9, (4, 5, 6), True),
            Chunk("t", target[10:], 10, (0, 1, 2, 3), True, num_logits=4),
            Chunk("u", third, 0, (7, 8), True),
        ],
    ]
    torch_rows = _runs(model, alone, "sdpa", False)
    monkeypatch.setattr(ig, "routes", ig.available)
    gpu_rows = _runs(model, alone, "kernel", False)
    tolerance = 1e-4 if dtype == "float32" else 0.1
    for key, logits in torch_rows.items():
        assert (gpu_rows[key].log_softmax(-1) - logits.log_softmax(-1)).abs().max() < tolerance, key
    invariant_alone = _runs(model, alone, "kernel", True)
    invariant_mixed = _runs(model, mixed, "kernel", True)
    assert [p for s, p in invariant_mixed if s == "t"] == [10, 11, 12, 13, 14]
    for (seq, position), logits in invariant_mixed.items():
        if seq == "t":
            assert torch.equal(logits, invariant_alone["t", position]), position


@TRITON
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_whose_weights_are_stored_n_by_k_gives_every_row_its_bits(monkeypatch, dtype):
    """`gpu_matmul.store_weights_nk` (what `python -m toolkit.bench.gpu --weights-nk` times on a GPU): every
    projection and the LM head keep their values and (K, N) shape over (N, K) storage, and the engine's
    batch-invariant GPU path, in the interpreter, gives every row the bits it gives over the weights as loaded."""
    from toolkit.config import ModelConfig
    from toolkit.engine.scheduler import ScheduledChunk as Chunk
    from toolkit.models import load_model

    monkeypatch.setenv("TOOLKIT_NATIVE", "0")
    monkeypatch.setattr(ig, "routes", ig.available)
    as_loaded = load_model(ModelConfig(**TINY, dtype=dtype)).model
    stored_nk = load_model(ModelConfig(**TINY, dtype=dtype)).model
    gm.store_weights_nk(stored_nk)
    pairs = [
        (a, b) for la, lb in zip(as_loaded.layers, stored_nk.layers) for a, b in zip(la.parameters(), lb.parameters())
    ]
    pairs.append((as_loaded.lm_head_t, stored_nk.lm_head_t))
    moved = [b for a, b in pairs if a.dim() == 2]
    layers = as_loaded.layers
    assert len(moved) == len(layers) * len(layers[0].projections) + 1  # every layer's projections and the LM head
    for a, b in pairs:
        assert torch.equal(a, b) and a.shape == b.shape
    assert all(b.stride() == (1, b.shape[0]) for b in moved)
    target, other = tuple((11 * j + 4) % 96 for j in range(9)), tuple((5 * j + 1) % 96 for j in range(6))
    steps = [
        [Chunk("o", other, 0, (4, 5), samples=True), Chunk("t", target[:5], 0, (0, 1), True)],
        [Chunk("t", target[5:], 5, (0, 1, 2), True, num_logits=4), Chunk("o", (7,), 6, (4, 5), True)],
    ]
    want, got = _runs(as_loaded, steps, "kernel", True), _runs(stored_nk, steps, "kernel", True)
    assert want.keys() == got.keys() and len(want) == 7
    for key in want:
        assert torch.equal(got[key], want[key]), key


@TRITON
@pytest.mark.parametrize("kv", [("int8", "block"), ("fp8_e4m3", "block"), ("int8", "tensor")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gpu_attention_reads_an_8_bit_cache_and_keeps_a_rows_bits_in_any_mix(monkeypatch, kv, dtype):
    """An int8 / fp8 cache with block or tensor scales on the GPU path (the Triton attention, each key's scale out
    of its dot product and each value's in its weight, as the CPU kernel reads it): torch's path over the same
    cache (de-quantised to the model's format, then sdpa) within the format's rounding; and in the batch-invariant
    mode a sequence's rows are the same bits alone as beside other sequences' chunks, chunked alike (a block's
    scale follows its own sequence's writes alone; where a chunk boundary falls changes it: a block whose scale
    grows is re-rounded)."""
    from toolkit.engine.scheduler import ScheduledChunk as Chunk

    monkeypatch.setenv("TOOLKIT_NATIVE", "0")
    model = load_model(ModelConfig(**TINY, dtype=dtype)).model
    target = tuple((11 * j + 4) % 96 for j in range(14))
    whole = [[Chunk("t", target, 0, (0, 1, 2, 3), samples=True, num_logits=14)]]
    first, then = (
        Chunk("t", target[:10], 0, (0, 1, 2), True),
        Chunk("t", target[10:], 10, (0, 1, 2, 3), True, num_logits=4),
    )
    alone = [[first], [then]]
    mixed = [
        [Chunk("o", target[2:11], 0, (4, 5, 6), samples=True), first],
        [then, Chunk("u", target[:5], 0, (7, 8), True)],
    ]
    torch_rows = _runs(model, whole, "sdpa", False, kv)
    monkeypatch.setattr(ig, "routes", ig.available)
    gpu_rows = _runs(model, whole, "kernel", False, kv)
    tolerance = 1e-4 if dtype == "float32" else 0.1
    for key, logits in torch_rows.items():
        assert (gpu_rows[key].log_softmax(-1) - logits.log_softmax(-1)).abs().max() < tolerance, key
    invariant_alone = _runs(model, alone, "kernel", True, kv)
    invariant_mixed = _runs(model, mixed, "kernel", True, kv)
    assert [p for s, p in invariant_mixed if s == "t"] == [10, 11, 12, 13, 14]
    for (seq, position), logits in invariant_mixed.items():
        if seq == "t":
            assert torch.equal(logits, invariant_alone["t", position]), position


@TRITON
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gpt2", "gemma2"])
def test_the_gpu_path_of_other_families_runs_in_the_interpreter(monkeypatch, family):
    """The engine's GPU forward of the other families a GPU serves (Qwen2's q/k/v biases, Qwen3's per-head q/k
    norms and its head_dim apart from hidden / heads, GPT-2's LayerNorm, learned positions and fused qkv; Gemma2's
    soft-capped, sliding-window attention on torch's sdpa, as the engine runs it on CUDA, beside the Triton norms and
    RoPE with the cache writes): fp32 logits are torch's CPU path's within 1e-4, bf16 ones no further from fp32 than
    torch's own bf16 path is (and a little), and in the batch-invariant mode (not Gemma2's: refused on CUDA) a
    sequence's rows are the same bits alone and beside other chunks."""
    monkeypatch.setenv("TOOLKIT_NATIVE", "0")
    target = tuple((11 * j + 4) % 96 for j in range(14))
    alone = [[ScheduledChunk("t", target, 0, (0, 1, 2, 3), samples=True, num_logits=14)]]
    mixed = [
        [
            ScheduledChunk("o", target[3:12], 0, (4, 5, 6), samples=True),
            ScheduledChunk("t", target[:10], 0, (0, 1, 2), True),
        ],
        [
            ScheduledChunk("t", target[10:], 10, (0, 1, 2, 3), True, num_logits=4),
            ScheduledChunk("u", target[:5], 0, (7, 8), True),
        ],
    ]
    models = {
        d: load_model(ModelConfig(name="hf", path=str(checkpoint_dir(family)), dtype=d)).model
        for d in (
            "float32",
            "bfloat16",
        )
    }
    torch_rows = {d: _runs(m, alone, "sdpa", False) for d, m in models.items()}
    monkeypatch.setattr(ig, "routes", ig.available)
    attention = "sdpa" if models["float32"].arch.needs_torch_attention else "kernel"
    gpu_rows = {d: _runs(m, alone, attention, False) for d, m in models.items()}

    def furthest(rows, truth):
        return max(float((rows[k].log_softmax(-1) - v.log_softmax(-1)).abs().max()) for k, v in truth.items())

    truth = torch_rows["float32"]
    assert furthest(gpu_rows["float32"], truth) < 1e-4
    assert furthest(gpu_rows["bfloat16"], truth) < 1.5 * furthest(torch_rows["bfloat16"], truth) + 0.02
    if attention == "sdpa":
        return
    invariant_alone = _runs(models["float32"], alone, "kernel", True)
    invariant_mixed = _runs(models["float32"], mixed, "kernel", True)
    assert [p for s, p in invariant_mixed if s == "t"] == [10, 11, 12, 13, 14]
    for (seq, position), logits in invariant_mixed.items():
        if seq == "t":
            assert torch.equal(logits, invariant_alone["t", position]), position
