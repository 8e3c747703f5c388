"""Decode steps in padded batch buckets over static buffers (toolkit/engine/graphs.py), the path a CUDA graph
captures, run here without capture (engine.cuda_graphs=eager): each real row gets the bits it gets unpadded
where the step's kernels are row-independent, padding never touches a sequence's cache, and the buckets cover
every decode batch the scheduler makes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import NATIVE_OFF, native_only
from tests.numerics import top2_margin
from toolkit.config import EngineConfig, ModelConfig
from toolkit.engine import graphs
from toolkit.engine.core import Engine
from toolkit.errors import ConfigError
from toolkit.models import load_model
from toolkit.sampling.params import SamplingParams
from toolkit.trace.diverge import first_difference

pytestmark = pytest.mark.native
MODEL = dict(
    name="tiny",
    seed=3,
    vocab_size=512,
    num_layers=2,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=512,
)


@pytest.fixture(scope="module")
def loaded():
    return load_model(ModelConfig(**MODEL))


def run(loaded, workload, **cfg) -> tuple[Engine, dict[tuple[str, int], torch.Tensor], dict[str, list[int]]]:
    """Every request of `workload` ((prompt length, max tokens, temperature) each, one arriving a step) to
    the end: each sampled row's logits by (request, position), and each request's tokens."""
    engine = Engine(
        loaded,
        EngineConfig(**{"max_num_batched_tokens": 16, "max_num_seqs": 5, "block_size": 4, **cfg}),
        SamplingParams(),
    )
    for i, (length, max_tokens, temperature) in enumerate(workload):
        engine.add_request(
            prompt_token_ids=[(31 * i + 7 * j) % 512 for j in range(length)],
            request_id=f"r{i}",
            arrival_step=i,
            sampling_params=SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True),
        )
    rows = {}
    while engine.has_unfinished():
        out = engine.step()
        for i, s in enumerate(out.samples):
            rows[s.request_id, s.position] = out.logits_RV[i].clone()
        engine.check_invariants()
    return engine, rows, {r: list(engine.sequences(r)[0].token_ids) for r in engine.request_ids()}


WORKLOAD = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 14), st.sampled_from([0.0, 1.0])), min_size=1, max_size=9
)


@native_only
@settings(max_examples=12, deadline=None)
@given(workload=WORKLOAD, max_num_seqs=st.integers(1, 7), block_size=st.sampled_from([1, 4, 16]))
def test_a_padded_bucket_gives_every_row_its_unpadded_bits(loaded, workload, max_num_seqs, block_size):
    """With row-independent kernels (engine.batch_invariant=true: the native attention reads each query's own
    context, the fixed-order matmul each row alone), every sampled row's logits and every token are the same bits
    in buckets (padded rows, keys padded with the scratch block) as packed unpadded, and most decode steps ran as
    a bucket."""
    cfg = dict(max_num_seqs=max_num_seqs, block_size=block_size, batch_invariant=True)
    _, want_rows, want_tokens = run(loaded, workload, cuda_graphs="off", **cfg)
    engine, got_rows, got_tokens = run(loaded, workload, cuda_graphs="eager", **cfg)
    assert got_tokens == want_tokens
    assert got_rows.keys() == want_rows.keys()
    for key, row in want_rows.items():
        assert torch.equal(got_rows[key].view(torch.int32), row.view(torch.int32)), key
    decodes = sum(max_tokens - 1 for _, max_tokens, _ in workload)
    assert engine.runner.graphs.replays > 0 or decodes == 0


@pytest.mark.numerics
@pytest.mark.parametrize("backend", ["kernel", "sdpa"] if not NATIVE_OFF else ["sdpa"])
def test_buckets_change_no_token_and_repeat_their_bits(loaded, backend):
    """Any backend: logits within fp32 rounding of the unpadded path's (the sdpa path reads a padded key axis, whose
    masked keys change the summation's grouping), so the same greedy tokens, except where the unpadded run's top-2
    margin is a near-tie that such rounding can flip (below twice the log-probabilities' bound: compared up to
    there); and a repeated run in buckets repeats every bit (what replay relies on). The buckets' sizes are each
    the smallest that holds."""
    tolerance = 1e-4  # |logit difference|; a log-probability moves by at most twice it
    workload = [(3 + 5 * i, 6 + 3 * i, 0.0) for i in range(7)]
    _, want_rows, want_tokens = run(loaded, workload, cuda_graphs="off", attention_backend=backend)
    first, rows, tokens = run(loaded, workload, cuda_graphs="eager", attention_backend=backend)
    _, again, _ = run(loaded, workload, cuda_graphs="eager", attention_backend=backend)
    compared = 0
    for rid, want in want_tokens.items():
        j = first_difference(want, tokens[rid])
        if j is not None:
            margin = top2_margin(want_rows[rid, j])
            assert margin < 4 * tolerance, (rid, j, margin)  # a near-tie, not a padding bug
        for (r, position), row in want_rows.items():
            if r == rid and (j is None or position <= j):
                assert float((rows[r, position] - row).abs().max()) < tolerance, (r, position)
                compared += 1
    assert compared >= len(want_rows) // 2
    assert all(torch.equal(rows[k], again[k]) for k in rows)
    used = first.runner.graphs.buckets
    assert {b for b, _ in used} <= set(graphs.BATCH_BUCKETS) | {5} and len(used) >= 3


@native_only
def test_padding_rows_touch_only_the_scratch_block(loaded):
    """The cache holds one block more than the block manager hands out; a bucket's padding rows write their keys
    there and nowhere else: after the same requests, every other block holds the bits the unpadded run left
    (row-independent kernels). A row that held a sequence in a fuller step is padding again in a smaller one."""
    caches = []
    for mode in ("off", "eager"):
        engine = Engine(
            loaded,
            EngineConfig(
                max_num_batched_tokens=64,
                max_num_seqs=4,
                block_size=4,
                num_kv_blocks=40,
                cuda_graphs=mode,
                batch_invariant=True,
            ),
            SamplingParams(),
        )
        assert engine.kv_cache.num_blocks == 40 + (mode == "eager")
        for layer in engine.kv_cache.layers:
            for t in layer:
                t.fill_(7.0)  # every slot known, written or not
        for i, tokens in enumerate((9, 3, 9, 9)):  # four sequences decode in bucket 4, then three
            engine.add_request(
                prompt_token_ids=list(range(1, 6)),
                request_id=f"r{i}",
                sampling_params=SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
            )
        while engine.has_unfinished():
            engine.step()
            bucket = engine.runner.graphs.buckets.get((4, 4)) if engine.runner.graphs else None
            if bucket is not None:
                live, scratch = engine.runner.graphs.filled[4, 4], engine.runner.graphs.scratch
                assert (bucket.slots_B[live:] == scratch * 4).all() and (bucket.tables_BW[live:] == scratch).all()
                assert (bucket.input_ids_B[live:] == 0).all() and (bucket.ctx_B[live:] == 1).all()
        caches.append([t.clone() for layer in engine.kv_cache.layers for t in layer])
    assert engine.runner.graphs.filled[4, 4] == 3  # the finished sequence's row went back to padding
    for unpadded, padded in zip(*caches):
        assert torch.equal(padded[:40], unpadded)
        assert (padded[40] != 7.0).any()  # the padding rows wrote the scratch block


@native_only
def test_a_buckets_width_is_capped_at_a_sequences_most_blocks_not_the_pool(loaded):
    """A context past the largest width bucket took a bucket as wide as the KV pool (a 60,000-block pool: a
    117 MiB table a step at 256 rows, and 3,750 splits a token); the cap is a sequence's most blocks
    (max_model_len / block_size), here 6 of 4 tokens where the pool holds hundreds, and the rows keep their bits."""
    workload = [(12, 10, 0.0), (16, 6, 1.0), (3, 19, 0.0)]  # contexts up to 22 tokens: 6 blocks, bucket 8 uncapped
    cfg = dict(block_size=4, max_model_len=22, num_kv_blocks=300, batch_invariant=True)
    _, want_rows, want_tokens = run(loaded, workload, cuda_graphs="off", **cfg)
    engine, got_rows, got_tokens = run(loaded, workload, cuda_graphs="eager", **cfg)
    assert engine.runner.graphs.scratch == 300
    widths = {w for _, w in engine.runner.graphs.buckets}
    assert max(widths) == 6, widths
    assert got_tokens == want_tokens
    assert all(torch.equal(got_rows[k], row) for k, row in want_rows.items())


def test_a_bucket_step_sends_its_inputs_in_one_copy(loaded, monkeypatch):
    """A bucketed decode step's inputs (ids, positions, slots, context lengths, tables; padding rows included) reach
    the device in one copy: on a GPU each copy is a transfer the host queues (five and more a step before)."""
    copies = []
    real = graphs.copy_into
    monkeypatch.setattr(graphs, "copy_into", lambda dst, src: (copies.append(dst.data_ptr()), real(dst, src)))
    engine, _, _ = run(loaded, [(5, 16, 0.0), (3, 12, 0.7), (9, 8, 0.0)], cuda_graphs="eager")
    assert engine.runner.graphs.replays > 5
    assert len(copies) == engine.runner.graphs.replays
    assert set(copies) == {b.inputs_F.data_ptr() for b in engine.runner.graphs.buckets.values()}


def test_the_smallest_bucket_that_holds(monkeypatch):
    for n in range(1, 600):
        got = graphs.bucket_of(n, graphs.BATCH_BUCKETS, 512)
        assert got >= min(n, 512) and got <= 512
        smaller = [b for b in graphs.BATCH_BUCKETS if n <= b < got]
        assert not smaller, (n, got)
    assert graphs.bucket_of(3, graphs.BATCH_BUCKETS, 3) == 3  # capped at max_num_seqs


def test_a_running_scale_cache_runs_its_buckets_eagerly_on_a_gpu():
    """engine.cuda_graphs=auto on CUDA captures the buckets, except over an 8-bit cache with running block or channel
    scales, whose writes look up the touched blocks (a capture of them would fail): eager buckets from the start.
    Static tensor scales are captured; off CUDA, auto is the runner's packing."""
    from toolkit.engine.backends import graph_mode

    def mode(device, kv="auto", granularity="block"):
        return graph_mode(EngineConfig(device=device, kv_cache_dtype=kv, kv_scale_granularity=granularity), "kernel")

    assert mode("cuda") == "capture" and mode("cuda", "bf16") == "capture"
    assert mode("cuda", "int8") == mode("cuda", "fp8_e4m3", "channel") == "eager"
    assert mode("cuda", "int8", "tensor") == "capture"
    assert mode("cpu") == mode("cpu", "int8") == "off"


def test_a_bad_cuda_graphs_value_is_one_line_naming_the_field(loaded):
    with pytest.raises(ConfigError, match="engine.cuda_graphs must be auto, eager or off, got 'yes'"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(ConfigError, match="cuda_graphs=eager runs the sdpa or kernel attention"):
        Engine(loaded, EngineConfig(cuda_graphs="eager", attention_backend="flex"), SamplingParams())
    assert Engine(loaded, EngineConfig(), SamplingParams()).runner.graphs is None  # auto on the CPU: no buckets
