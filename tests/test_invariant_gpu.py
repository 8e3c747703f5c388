"""The batch-invariant GPU kernels (toolkit/native/invariant_gpu.py) run here under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 where torch sees no GPU): every row is the same bits whatever batch it is
in, and the float64 result within the format's rounding; the torch fallback keeps the same promises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.native import invariant_gpu as ig

TRITON = pytest.mark.skipif(not ig.available(torch.empty(0)),
                            reason="Triton does not import here, or runs neither a GPU nor its interpreter "
                                   "(TRITON_INTERPRET=1): the torch fallback is tested instead")
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def _subsets(draw, m: int) -> list[list[int]]:
    """Other batches that hold some of the m rows: alone, a slice, a shuffled subset."""
    rows = draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=min(m, 9), unique=True))
    return [[rows[0]], rows, sorted(rows)]


def _matmul_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x @ w - exact| for fp32 sums of k products: k * 2^-24 * (|x| @ |w|), and a little."""
    return (x.shape[1] + 2) * 2.0 ** -24 * (x.double().abs() @ w.double().abs()) + 1e-30


@pytest.mark.parametrize("impl", [pytest.param(ig.matmul, marks=TRITON, id="triton"),
                                  pytest.param(ig.matmul_rows, id="torch-rows")])
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


@pytest.mark.parametrize("impl", [pytest.param(ig.rms_norm, marks=TRITON, id="triton"),
                                  pytest.param(ig.rms_norm_rows, id="torch-rows")])
@settings(max_examples=12, deadline=None)
@given(data=st.data(), m=st.integers(1, 20), d=st.sampled_from([1, 7, 64, 255, 256, 576, 700]), dtype=DTYPES,
       scale=st.sampled_from([1e-3, 1.0, 300.0]))
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
@pytest.mark.parametrize("impl", [pytest.param(ig.logsumexp, marks=TRITON, id="triton"),
                                  pytest.param(ig.logsumexp_rows, id="torch-rows")])
@settings(max_examples=12, deadline=None)
@given(data=st.data(), r=st.integers(1, 12), v=st.sampled_from([1, 3, 1000, 1024, 1025, 5000]),
       masked=st.booleans())
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
    alone = ig.matmul(x[:1], w)
    try:
        ig.BLOCK_K = 16  # what a row-count-dependent choice would give the batch
        batched = ig.matmul(x, w)
    finally:
        ig.BLOCK_K = 32
    assert not torch.equal(batched[:1], alone)
    assert torch.equal(ig.matmul(x, w)[:1], alone)
