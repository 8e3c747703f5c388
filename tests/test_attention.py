"""The native paged-attention kernel against torch's SDPA path and a dense reference; the native
RoPE, RMSNorm and SiLU kernels against the torch code they replace."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import native_only
from tests.numerics import with_threads
from toolkit.models.decoder import rope_tables, rotate_half
from toolkit.native import library
from toolkit.native.ops import add_rms_norm_cpu, paged_attention_cpu, paged_attention_cpu_q8, rope_cpu, silu_mul_cpu
from toolkit.sampling.params import SamplingParams

pytestmark = native_only


def dense_reference(q_NHD, k_cache, v_cache, tables, query_table, query_ctx, scale):
    """float64 attention of each query over its sequence's first ctx keys, read by position."""
    n, h, d = q_NHD.shape
    _, bs, kh, _ = k_cache.shape
    out = torch.empty(n, h, d, dtype=torch.float64)
    for i in range(n):
        ctx = int(query_ctx[i])
        table = tables[int(query_table[i])]
        slots = [int(table[p // bs]) * bs + p % bs for p in range(ctx)]
        k = k_cache.view(-1, kh, d)[slots].double().repeat_interleave(h // kh, dim=1)  # (T, H, D)
        v = v_cache.view(-1, kh, d)[slots].double().repeat_interleave(h // kh, dim=1)
        w = torch.softmax(torch.einsum("hd,thd->ht", q_NHD[i].double(), k) * scale, dim=-1)
        out[i] = torch.einsum("ht,thd->hd", w, v)
    return out


def attention_case(gen, h, kh, d, block_size, contexts):
    """Random K/V caches in shuffled blocks, each sequence's block table, and a few queries per sequence
    (a chunk ending at its context): (q, k_cache, v_cache, block_tables, query_table, query_ctx)."""
    num_blocks = sum(-(-c // block_size) for c in contexts) + 3
    k_cache = torch.randn(num_blocks, block_size, kh, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kh, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-c // block_size) for c in contexts)
    tables, rows_table, rows_ctx = [], [], []
    for s, c in enumerate(contexts):
        need = -(-c // block_size)
        tables.append(perm[:need] + [0] * (width - need))
        perm = perm[need:]
        for q_pos in range(max(0, c - 3), c):
            rows_table.append(s)
            rows_ctx.append(q_pos + 1)
    q = torch.randn(len(rows_ctx), h, d, generator=gen)
    return q, k_cache, v_cache, torch.tensor(tables), torch.tensor(rows_table), torch.tensor(rows_ctx)


@settings(max_examples=60)
@given(
    heads=st.sampled_from(
        [(4, 2, 16), (9, 3, 64), (4, 4, 64), (8, 2, 128), (6, 3, 8), (8, 1, 64), (10, 2, 64), (12, 2, 128)]
    ),  # query heads per KV head: 1-8
    block_size=st.sampled_from([1, 4, 16, 32]),
    contexts=st.lists(st.integers(1, 90), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_kernel_matches_dense_reference(heads, block_size, contexts, seed):
    h, kh, d = heads
    gen = torch.Generator().manual_seed(seed)
    q, k_cache, v_cache, tables_t, qt, qc = attention_case(gen, h, kh, d, block_size, contexts)
    got = paged_attention_cpu(q, k_cache, v_cache, tables_t, qt, qc, d**-0.5)
    want = dense_reference(q, k_cache, v_cache, tables_t, qt, qc, d**-0.5)
    assert (got.double() - want).abs().max().item() < 2e-5
    # each query's result does not depend on the others: alone, it gets the same bits
    for i in range(0, q.shape[0], 3):
        alone = paged_attention_cpu(q[i : i + 1], k_cache, v_cache, tables_t, qt[i : i + 1], qc[i : i + 1], d**-0.5)
        assert torch.equal(alone[0], got[i])


@settings(max_examples=40, deadline=None)
@given(
    heads=st.sampled_from([(9, 3, 64), (4, 4, 64), (8, 2, 128), (8, 1, 64), (10, 2, 64), (32, 8, 64), (3, 1, 128)]),
    cache=st.sampled_from(["float32", "bfloat16", "float16", "int8"]),
    threads=st.integers(2, 7),
    contexts=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    seed=st.integers(0, 1000),
)
def test_a_querys_heads_split_over_the_threads_give_its_bits(heads, cache, threads, contexts, seed):
    """Fewer queries than threads (a decode step of one sequence): each query's heads go in ranges over the
    threads, and every head gets the bits it gets on one thread, where the query runs whole."""
    h, kh, d = heads
    gen = torch.Generator().manual_seed(seed)
    q, k_cache, v_cache, tables, qt, qc = attention_case(gen, h, kh, d, 16, contexts)
    q, qt, qc = q[-len(contexts) :], qt[-len(contexts) :], qc[-len(contexts) :]  # a decode row a sequence
    if cache == "int8":
        k8, v8 = ((c * 40).round().clamp(-127, 127).to(torch.int8) for c in (k_cache, v_cache))
        scales = torch.rand(2, k_cache.shape[0], kh, generator=gen) / 40 + 1e-3

        def run():
            out = torch.empty(q.shape, dtype=torch.float32)
            return paged_attention_cpu_q8(q, k8, v8, scales[0], scales[1], tables, qt, qc, d**-0.5, out)
    else:
        k16, v16 = k_cache.to(getattr(torch, cache)), v_cache.to(getattr(torch, cache))

        def run():
            return paged_attention_cpu(q, k16, v16, tables, qt, qc, d**-0.5)

    whole = with_threads(1, run)
    split = with_threads(threads, run)
    assert torch.equal(split, whole)
    assert torch.isfinite(split).all()


def test_kernel_and_sdpa_engines_agree(tiny):
    from tests.conftest import make_engine

    requests = [
        {
            "prompt_token_ids": list(range(3 + 7 * i, 40 + 11 * i)),
            "arrival_step": i,
            "sampling_params": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        }
        for i in range(4)
    ]
    outs = {}
    for backend in ("kernel", "sdpa"):
        engine = make_engine(tiny, max_num_batched_tokens=32, max_num_seqs=4, attention_backend=backend)
        outs[backend] = [o.output_token_ids for o in engine.generate(requests)]
    assert outs["kernel"] == outs["sdpa"]


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    heads=st.integers(1, 6),
    half=st.sampled_from([1, 3, 8, 32, 64]),
    extra=st.integers(0, 5),
    seed=st.integers(0, 1000),
)
def test_native_rope_is_the_torch_expression_bit_for_bit(rows, heads, half, extra, seed):
    """rope_cpu(x) == x * cos + rotate_half(x) * sin exactly, for strided rows (a view into q|k|v)."""
    gen = torch.Generator().manual_seed(seed)
    d = 2 * half
    cos, sin = torch.randn(300, d, generator=gen), torch.randn(300, d, generator=gen)
    fused = torch.randn(rows, (heads + extra) * d, generator=gen)
    x = fused[:, : heads * d].view(rows, heads, d)
    pos = torch.randint(0, 300, (rows,), generator=gen)
    want = x * cos[pos].unsqueeze(1) + rotate_half(x) * sin[pos].unsqueeze(1)
    assert torch.equal(rope_cpu(x, cos, sin, pos), want)


def test_native_rope_on_the_model_tables_and_out_of_range_positions():
    """On the cos/sin tables the model builds (equal halves), and a clear error past the table."""
    from toolkit.models.decoder import DecoderArch

    arch = DecoderArch(
        vocab_size=8,
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    cos, sin = rope_tables(arch, torch.device("cpu"))
    x = torch.randn(64, 6, 16)
    pos = torch.arange(64)
    assert torch.equal(rope_cpu(x, cos, sin, pos), x * cos[pos].unsqueeze(1) + rotate_half(x) * sin[pos].unsqueeze(1))
    with pytest.raises(IndexError, match="outside the rotary table of 64 positions"):
        rope_cpu(x[:1], cos, sin, torch.tensor([64]))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 130),
    width=st.sampled_from([16, 64, 576, 2048]),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    residual=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_native_add_rms_norm_against_float64(rows, width, scale, residual, seed):
    """x + r is torch's sum exactly (and written into x); the norm is near a float64 RMSNorm, within a bound derived
    from the build's lanes (each lane sums width / lanes squares in order, a relative error of at most that many
    fp32 ulps, halved by the square root; then the lanes' tree and the products: a few more); a row's bits do not
    depend on the other rows or the thread count."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * scale
    r = torch.randn(rows, width, generator=gen) * scale if residual else None
    w = torch.randn(width, generator=gen)
    want_x = x + r if residual else x.clone()
    want = (want_x.double() * torch.rsqrt(want_x.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * w.double()
    got_x, got = add_rms_norm_cpu(x, r, w, 1e-5)
    assert torch.equal(got_x, want_x) and torch.equal(x, want_x)
    lanes = library.native().profile.lanes
    ulps = 4 + (width / lanes + lanes.bit_length()) / 2  # 16 lanes: 7 ulps at width 16, 70.5 at 2048
    assert ((got.double() - want).abs() <= ulps * 2.0**-23 * want.abs() + 1e-30).all()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = add_rms_norm_cpu(want_x[-1:].clone(), None, w, 1e-5)[1]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], add_rms_norm_cpu(want_x.clone(), None, w, 1e-5)[1][-1])


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 70),
    width=st.sampled_from([16, 48, 1536]),
    scale=st.sampled_from([0.1, 4.0, 30.0]),
    seed=st.integers(0, 1000),
)
def test_native_silu_mul_against_float64(rows, width, scale, seed):
    """silu(gate) * up from [gate | up] rows within 4 fp32 ulps (relative) of float64, as torch's own
    silu is; large negative gates go to ~0, NaN stays NaN."""
    gen = torch.Generator().manual_seed(seed)
    gu = torch.randn(rows, 2 * width, generator=gen) * scale
    gu[0, :3] = torch.tensor([-95.0, 95.0, float("nan")])
    gate, up = gu[:, :width].double(), gu[:, width:].double()
    want = gate * torch.sigmoid(gate) * up
    got = silu_mul_cpu(gu).double()
    assert got[0, 2].isnan()
    ok = (got - want).abs() <= 4 * 2.0**-23 * want.abs() + 1e-30
    ok[0, 0] = abs(got[0, 0]) < 1e-32  # exp(-95) is past fp32: ~0, not a 4-ulp match
    ok[0, 2] = True
    assert ok.all(), (got - want).abs().max()


def _both_paths(model):
    """Make `model` run every forward twice, from the same KV cache: layer by layer from Python, then all
    layers in one native call; return a list that collects (steps, steps whose logits and caches agree)."""
    seen = [0, 0]
    forward = model.forward

    def both(ids, positions, attn, kv_caches, rows, num_layers=None, native_matmul=False, schedule=None, **mode):
        before = [(k.clone(), v.clone()) for k, v in kv_caches]
        model.fused_layers = False
        want = forward(ids, positions, attn, kv_caches, rows, num_layers, native_matmul, schedule, **mode)
        want_kv = [(k.clone(), v.clone()) for k, v in kv_caches]
        for (k, v), (k0, v0) in zip(kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        model.fused_layers = True
        got = forward(ids, positions, attn, kv_caches, rows, num_layers, native_matmul, schedule, **mode)
        seen[0] += 1
        seen[1] += torch.equal(got, want) and all(
            torch.equal(k, k1) and torch.equal(v, v1) for (k, v), (k1, v1) in zip(kv_caches, want_kv)
        )
        return got

    model.forward = both
    return seen


def _run_both(loaded, prompts, max_tokens, **engine_kwargs):
    from tests.conftest import make_engine

    seen = _both_paths(loaded.model)
    try:
        engine = make_engine(loaded, **engine_kwargs)
        for p in prompts:
            engine.add_request(
                prompt_token_ids=p,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            )
        while engine.has_unfinished():
            engine.step()
    finally:
        del loaded.model.forward
        loaded.model.fused_layers = True
    return seen


@settings(max_examples=15)
@given(
    prompts=st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=40), min_size=1, max_size=5),
    budget=st.integers(8, 48),
    block_size=st.sampled_from([4, 16]),
)
def test_fused_layers_are_the_layer_by_layer_forward_bit_for_bit(tiny, prompts, budget, block_size):
    """All layers in one native call (csrc/decoder_layers.c) give the logits and KV cache bits of the
    layer-by-layer forward, in mixed prefill-chunk + decode steps (tiny: head_dim 16, the scalar attention)."""
    steps, same = _run_both(
        tiny, prompts, 6, max_num_batched_tokens=budget, max_num_seqs=8, block_size=block_size, num_kv_blocks=128
    )
    assert steps > 0 and same == steps


def test_fused_layers_on_smollm2_bit_for_bit(smollm2):
    """The same on the real model (head_dim 64, the SIMD attention path), prompts chunked under a small budget."""
    prompts = [[(7 * i + 3 * j) % 49152 for j in range(n)] for i, n in enumerate((37, 5, 70, 12))]
    steps, same = _run_both(smollm2, prompts, 5, max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=64)
    assert steps >= 6 and same == steps


def test_fused_layers_refuse_a_slot_outside_the_cache_before_writing(tiny):
    """A KV slot outside the cache is refused with an IndexError before any layer writes (the C call
    checks every slot first): the cache is left as it was."""
    import dataclasses

    from tests.conftest import make_engine

    model, checked = tiny.model, []
    forward = model.forward

    def tampered(ids, positions, attn, kv_caches, rows, num_layers=None, native_matmul=False, schedule=None, **mode):
        if not checked:
            before = [(k.clone(), v.clone()) for k, v in kv_caches]
            slots = attn.slot_mapping_N.clone()
            slots[-1] = kv_caches[0][0].shape[0] * kv_caches[0][0].shape[1]  # one past the last slot
            with pytest.raises(IndexError, match="KV slot"):
                forward(
                    ids,
                    positions,
                    dataclasses.replace(attn, slot_mapping_N=slots),
                    kv_caches,
                    rows,
                    num_layers,
                    native_matmul,
                    schedule,
                    **mode,
                )
            checked.append(
                all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv_caches, before))
            )
        return forward(ids, positions, attn, kv_caches, rows, num_layers, native_matmul, schedule, **mode)

    model.forward = tampered
    try:
        engine = make_engine(tiny, max_num_batched_tokens=16, max_num_seqs=2, num_kv_blocks=8)
        engine.add_request(
            prompt_token_ids=list(range(5, 25)),
            sampling_params=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        )
        while engine.has_unfinished():
            engine.step()
    finally:
        del model.forward
    assert checked == [True]


@settings(max_examples=30, deadline=None)
@given(
    heads=st.sampled_from([(9, 3, 64), (8, 2, 128), (32, 8, 64), (4, 4, 64)]),
    cache=st.sampled_from(["float32", "bfloat16", "int8"]),
    chunks=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 70)), min_size=1, max_size=4),
    threads=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_a_prompt_chunks_queries_share_tiles_and_keep_their_bits(heads, cache, chunks, threads, seed):
    """A prompt chunk's consecutive queries go in runs that take each tile of keys in turn (the kernel's
    query_runs): every query gets the bits it gets alone and on one thread, whatever the run it fell in, and
    the fp32 cache's result is the float64 attention's."""
    h, kh, d = heads
    gen = torch.Generator().manual_seed(seed)
    bs, tables, qt, qc = 16, [], [], []
    ends = [start + n for start, n in chunks]
    width = max(-(-e // bs) for e in ends)
    perm = torch.randperm(sum(-(-e // bs) for e in ends) + 2, generator=gen).tolist()
    k_cache = torch.randn(len(perm), bs, kh, d, generator=gen)
    v_cache = torch.randn(len(perm), bs, kh, d, generator=gen)
    for s, (start, n) in enumerate(chunks):
        need = -(-(start + n) // bs)
        tables.append(perm[:need] + [0] * (width - need))
        perm = perm[need:]
        qt += [s] * n
        qc += list(range(start + 1, start + n + 1))
    q = torch.randn(len(qc), h, d, generator=gen)
    tables_t, qt_t, qc_t = torch.tensor(tables), torch.tensor(qt), torch.tensor(qc)
    if cache == "int8":
        k8, v8 = ((c * 40).round().clamp(-127, 127).to(torch.int8) for c in (k_cache, v_cache))
        scales = torch.rand(2, k_cache.shape[0], kh, generator=gen) / 40 + 1e-3

        def run(rows):
            out = torch.empty(q[rows].shape, dtype=torch.float32)
            return paged_attention_cpu_q8(
                q[rows], k8, v8, scales[0], scales[1], tables_t, qt_t[rows], qc_t[rows], d**-0.5, out
            )
    else:
        kc, vc = k_cache.to(getattr(torch, cache)), v_cache.to(getattr(torch, cache))

        def run(rows):
            return paged_attention_cpu(q[rows], kc, vc, tables_t, qt_t[rows], qc_t[rows], d**-0.5)

    every = slice(None)
    got = with_threads(threads, lambda: run(every))
    assert torch.equal(with_threads(1, lambda: run(every)), got)
    for i in sorted({0, len(qc) - 1, *range(0, len(qc), 7)}):
        assert torch.equal(with_threads(threads, lambda: run(slice(i, i + 1)))[0], got[i])
    if cache == "float32":
        want = dense_reference(q, k_cache, v_cache, tables_t, qt_t, qc_t, d**-0.5)
        assert (got.double() - want).abs().max().item() < 2e-5
