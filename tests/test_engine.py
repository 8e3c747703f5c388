"""Engine behaviour: one forward per step, chunking, scheduling, lifecycle, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine
from toolkit.config import EngineConfig, ModelConfig
from toolkit.engine.core import Engine
from toolkit.engine.request import SequenceStatus
from toolkit.errors import ConfigError, RequestError
from toolkit.models import load_model
from toolkit.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class CountingModel(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.native
def test_a_mixed_step_makes_exactly_one_forward(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=16, max_num_seqs=4)
    counter = CountingModel(tiny.model)
    engine.runner.model = counter
    engine.add_request(prompt_token_ids=list(range(10, 14)), sampling_params=GREEDY)
    engine.add_request(prompt_token_ids=list(range(100, 140)), sampling_params=GREEDY, arrival_step=2)
    mixed = 0
    while engine.has_unfinished():
        before = counter.calls
        out = engine.step()
        assert counter.calls - before == (1 if out.batch_size else 0)
        if out.num_decode_tokens and out.num_prefill_tokens:
            mixed += 1
    assert mixed >= 2  # the 40-token prompt is prefilled in chunks beside the running decode
    assert engine.runner.num_forwards == counter.calls


@pytest.mark.native
def test_last_prompt_chunk_samples_in_the_same_step(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=4, max_num_seqs=1)
    rid = engine.add_request(prompt_token_ids=list(range(1, 11)), sampling_params=GREEDY)  # 10 tokens: 4 + 4 + 2
    outs = [engine.step() for _ in range(3)]
    assert [o.num_prefill_tokens for o in outs] == [4, 4, 2]
    assert [len(o.samples) for o in outs] == [0, 0, 1]
    assert outs[2].samples[0].request_id == rid and outs[2].samples[0].position == 10
    assert engine.requests[rid].status is SequenceStatus.DECODING


@pytest.mark.native
def test_decode_first_and_budget(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=8, max_num_seqs=4)
    for _ in range(3):
        engine.add_request(prompt_token_ids=list(range(1, 6)), sampling_params=GREEDY, arrival_step=0)
    engine.add_request(prompt_token_ids=list(range(1, 30)), sampling_params=GREEDY, arrival_step=3)
    decoding_before: set[str] = set()
    while engine.has_unfinished():
        out = engine.step()
        assert out.num_decode_tokens + out.num_prefill_tokens <= 8
        sampled = {s.request_id for s in out.samples}
        # every request that was decoding before this step got its token in this step
        assert decoding_before - set(out.finished) <= sampled | set(out.finished)
        decoding_before = {r.request_id for r in engine.requests.values() if r.status is SequenceStatus.DECODING}


@pytest.mark.native
def test_lifecycle_and_block_release(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=4, max_num_seqs=2, num_kv_blocks=16)
    rid = engine.add_request(prompt_token_ids=list(range(1, 7)), sampling_params=GREEDY, arrival_step=1)
    seen = [engine.requests[rid].status]
    while engine.has_unfinished():
        engine.step()
        seen.append(engine.requests[rid].status)
    order = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
    assert order == [
        SequenceStatus.PENDING,
        SequenceStatus.PREFILLING,
        SequenceStatus.DECODING,
        SequenceStatus.FINISHED,
    ]
    out = engine.output(rid)
    assert out.finish_reason == "length" and len(out.output_token_ids) == 8
    assert engine.block_manager.num_free_blocks == 16
    m = out.metrics
    assert m.admitted_step >= 1 and 0 <= m.queue_s <= m.ttft_s <= m.e2e_s and m.tpot_s > 0


@pytest.mark.native
def test_eos_and_stop_token_ids(tiny):
    engine = make_engine(tiny)
    first = engine.generate([{"prompt_token_ids": [5, 6, 7], "sampling_params": GREEDY}])[0].output_token_ids
    stop_at = first[3]
    out = engine.generate(
        [{"prompt_token_ids": [5, 6, 7], "sampling_params": GREEDY.replace(stop_token_ids=(stop_at,))}]
    )[0]
    assert out.output_token_ids == first[: first.index(stop_at) + 1] and out.finish_reason == "stop"


@pytest.mark.native
def test_seeded_sampling_is_independent_of_batch(tiny):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = make_engine(tiny).generate([{"prompt_token_ids": [1, 2, 3], "sampling_params": params}])[0]
    engine = make_engine(tiny, max_num_batched_tokens=6, max_num_seqs=3)
    others = [{"prompt_token_ids": list(range(i, i + 9)), "sampling_params": params.replace(seed=i)} for i in range(5)]
    outs = engine.generate(others[:2] + [{"prompt_token_ids": [1, 2, 3], "sampling_params": params}] + others[2:])
    assert outs[2].output_token_ids == alone.output_token_ids
    assert len({o.output_token_ids for o in outs}) > 1  # different seeds give different samples


@pytest.mark.native
def test_small_pool_preempts_and_still_finishes(tiny):
    ample = make_engine(tiny, num_kv_blocks=256, block_size=4, max_num_seqs=6)
    tight = make_engine(tiny, num_kv_blocks=12, block_size=4, max_num_seqs=6)
    reqs = [
        {"prompt_token_ids": list(range(10 * i + 1, 10 * i + 9)), "sampling_params": GREEDY.replace(max_tokens=20)}
        for i in range(6)
    ]
    a = ample.generate(reqs)
    b = tight.generate(reqs)
    assert sum(o.metrics.num_preemptions for o in b) > 0
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert tight.block_manager.num_free_blocks == 12


@pytest.mark.native
def test_abort_frees_blocks(tiny):
    engine = make_engine(tiny, num_kv_blocks=32)
    rid = engine.add_request(prompt_token_ids=list(range(1, 20)), sampling_params=GREEDY)
    keep = engine.add_request(prompt_token_ids=list(range(1, 5)), sampling_params=GREEDY)
    engine.step()
    engine.abort(rid)
    assert engine.output(rid).finish_reason == "abort"
    engine.run_until_done()
    assert engine.output(keep).finish_reason == "length"
    assert engine.block_manager.num_free_blocks == 32


@pytest.mark.native
def test_small_vocab_model_takes_token_ids_only(tiny_small_vocab):
    engine = make_engine(tiny_small_vocab)
    out = engine.generate([{"prompt_token_ids": [1, 2, 3], "sampling_params": GREEDY}])[0]
    assert out.text == "" and all(0 <= t < 64 for t in out.output_token_ids)
    with pytest.raises(RequestError, match="give prompt_token_ids"):
        engine.add_request("hello")
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request(prompt_token_ids=[1, 64])


@pytest.mark.native
@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_more_alternatives_than_the_vocabulary_is_refused_with_one_line(name):
    """20 alternatives of a 17-token vocabulary failed the request mid-step (torch.topk's "selected index k out
    of range", on the CPU's sampler and the GPU's); it is refused at intake, naming the field, and the whole
    vocabulary is still taken."""
    engine = make_engine(load_model(ModelConfig(name="tiny", seed=1, vocab_size=17)))
    with pytest.raises(RequestError, match=f"^{name} 18 asks for more alternatives than the vocabulary's 17 tokens"):
        engine.add_request(prompt_token_ids=[1, 2], sampling_params={name: 18, "max_tokens": 2})
    assert not engine.requests
    rid = engine.add_request(prompt_token_ids=[1, 2], sampling_params={name: 17, "max_tokens": 2, "seed": 0})
    engine.run_until_done()
    out = engine.output(rid)
    assert out.finish_reason == "length", out  # the whole vocabulary as alternatives, no error


@pytest.mark.native
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt=""), "empty"),
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt_token_ids=[1] * 2048), "context"),
        (
            dict(prompt_token_ids=[1, 2], sampling_params={"max_tokens": 0}),
            "max_tokens must be a positive integer, got 0",
        ),
        (dict(prompt_token_ids=[1, 2], sampling_params={"max_tokens": 5000}), "max_model_len"),
        (dict(prompt_token_ids=[1, 2], sampling_params={"temperature": -1}), "temperature"),
        (dict(prompt_token_ids=[1, 2], sampling_params={"bogus": 1}), "unknown sampling option"),
        (dict(prompt_token_ids=[1, -3]), "outside the vocabulary"),
        (dict(prompt="a", messages=[{"role": "user", "content": "a"}]), "exactly one"),
        (dict(prompt=5, prompt_token_ids=[1]), "prompt must be a string"),  # beside ids, it is their text
        (dict(messages=[{"role": "user"}]), "messages"),
    ],
)
def test_bad_requests_are_refused_with_one_line(tiny, kwargs, match):
    engine = make_engine(tiny)
    with pytest.raises(RequestError, match=match) as info:
        engine.add_request(**kwargs)
    assert "\n" not in str(info.value)
    assert not engine.requests and not engine.has_unfinished()


@pytest.mark.native
def test_request_that_can_never_fit_the_pool_is_refused(tiny):
    engine = make_engine(tiny, num_kv_blocks=4, block_size=4)
    with pytest.raises(RequestError, match="KV pool"):
        engine.add_request(prompt_token_ids=list(range(1, 12)), sampling_params=GREEDY)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), "engine.block_size must be a positive integer, got 0"),
        (dict(max_num_batched_tokens=4, max_num_seqs=8), "max_num_batched_tokens"),
        (dict(device="tpu"), "engine.device"),
        (dict(num_threads=100_000), r"engine.num_threads must be an integer in \[1, 1024\]"),  # torch's SIGSEGV
    ],
)
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    backend=st.sampled_from(["kernel", "sdpa"]),
    block_size=st.sampled_from([1, 4, 16]),
    small_step=st.sampled_from([0, 64]),
)
def test_step_inputs_are_the_per_token_definition(tiny, data, backend, block_size, small_step):
    """The runner builds positions, cache slots, per-token chunk index and logits rows with tensor ops (or, in a
    step of at most SMALL_STEP_TOKENS tokens, with Python's ints; 0 here: tensor ops always); they must be the
    per-token definition: position = start + i, slot = table[pos // bs] * bs + pos % bs, in the packing order
    decodes, verifications, prefills."""
    from toolkit.engine import runner as runner_module
    from toolkit.engine.runner import ModelRunner
    from toolkit.engine.scheduler import ScheduledBatch, ScheduledChunk
    from toolkit.kv.paged_cache import PagedKVCache

    layers, kv_heads, head_dim = tiny.model.kv_shape
    cache = PagedKVCache(layers, 64, block_size, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    runner = ModelRunner(tiny.model, cache, torch.device("cpu"), backend)
    chunks = []
    for s in range(data.draw(st.integers(1, 6))):
        n = data.draw(st.integers(1, 9))
        start = data.draw(st.integers(0, 40))
        blocks = -(-(start + n) // block_size)
        table = tuple(data.draw(st.lists(st.integers(0, 63), min_size=blocks, max_size=blocks)))
        logits = data.draw(st.integers(1, n)) if n > 1 and data.draw(st.booleans()) else 1
        chunks.append(
            ScheduledChunk(
                f"s{s}",
                tuple(range(100 * s, 100 * s + n)),
                start,
                table,
                samples=data.draw(st.booleans()),
                num_logits=logits,
            )
        )
    kept, runner_module.SMALL_STEP_TOKENS = runner_module.SMALL_STEP_TOKENS, small_step
    try:
        batch = ScheduledBatch(step=0, chunks=tuple(chunks), num_decode_tokens=0, num_prefill_tokens=0)
        inputs = runner.prepare(batch)
    finally:
        runner_module.SMALL_STEP_TOKENS = kept
    ordered = (
        [c for c in chunks if c.num_tokens == 1]
        + [c for c in chunks if c.num_tokens > 1 and c.num_logits > 1]
        + [c for c in chunks if c.num_tokens > 1 and c.num_logits == 1]
    )
    ids, positions, slots, chunk_of, rows = [], [], [], [], []
    for k, c in enumerate(ordered):
        if c.samples:
            rows += range(len(ids) + c.num_tokens - c.num_logits, len(ids) + c.num_tokens)
        for i, t in enumerate(c.token_ids):
            pos = c.start_pos + i
            ids.append(t)
            positions.append(pos)
            slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
            chunk_of.append(k)
    assert inputs.input_ids_N.tolist() == ids
    assert inputs.positions_N.tolist() == positions
    assert inputs.attn.slot_mapping_N.tolist() == slots
    assert inputs.logits_rows_R.tolist() == rows
    if backend == "kernel":
        assert inputs.attn.query_table_N.tolist() == chunk_of
        assert inputs.attn.query_ctx_N.tolist() == [p + 1 for p in positions]


@pytest.mark.native
def test_an_engine_is_freed_as_soon_as_it_is_dropped(tiny):
    """No reference cycle through the engine: its KV cache goes with its last reference, not at the next
    run of the cycle collector (a benchmark building engine after engine grew by 2 GB a run when the
    stages held the engine's bound methods)."""
    import gc
    import weakref

    from toolkit.config import SpeculativeConfig

    gc.disable()
    try:
        engine = Engine(tiny, EngineConfig(max_num_seqs=4), SamplingParams(), SpeculativeConfig(method="ngram"))
        engine.generate(
            [
                {
                    "prompt_token_ids": [1, 2, 3, 1, 2],
                    "sampling_params": SamplingParams(max_tokens=4, structured_outputs={"choice": ["yes", "no"]}),
                }
            ]
        )
        cache = weakref.ref(engine.kv_cache)
        del engine
        assert cache() is None
    finally:
        gc.enable()


@pytest.mark.native
def test_a_penalty_the_sampler_makes_that_empties_a_row_is_that_rows_error_only(tiny):
    """The repetition penalty, last before the sampler's own processors, is made inside the sampler's pass; one
    that leaves a row no finite logit (every allowed token seen, pushed down and multiplied by inf) is that
    request's error naming the processor, found after the pass, and its batch mates sample as they do alone."""
    order = ["logit_bias", "allowed_token_ids", "repetition_penalty", "temperature"]
    doomed = SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=4,
        ignore_eos=True,
        processors=order,
        logit_bias={5: -100.0, 6: -100.0},
        allowed_token_ids=[5, 6],
        repetition_penalty=1e300,
    )
    fine = SamplingParams(temperature=0.8, seed=4, max_tokens=4, ignore_eos=True, repetition_penalty=1.3)
    alone = make_engine(tiny).generate([{"prompt_token_ids": [7, 8, 9, 7], "sampling_params": fine}])[0]
    engine = make_engine(tiny)
    engine.add_request(prompt_token_ids=[5, 6, 5], request_id="doomed", sampling_params=doomed)
    engine.add_request(prompt_token_ids=[7, 8, 9, 7], request_id="fine", sampling_params=fine)
    rows = []
    while engine.has_unfinished():
        rows += engine.step().samples
    doomed_rows = [r for r in rows if r.request_id == "doomed"]
    assert [(r.token_id, r.finish_reason, r.error) for r in doomed_rows] == [
        (-1, "error", "empty support: processor 'repetition_penalty' removed every token")
    ]
    assert [r.token_id for r in rows if r.request_id == "fine"] == list(alone.output_token_ids)
    assert len(alone.output_token_ids) == 4
