"""toolkit.LLM, the vLLM-shaped entry point: the engine's outputs, every call a replayable recorded run."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from toolkit import LLM, SamplingParams, replay
from toolkit.config import EngineConfig
from toolkit.engine.core import Engine
from toolkit.errors import ConfigError, RequestError
from toolkit.llm import checkpoint_dtype
from toolkit.trace.reader import read_requests, read_samples

pytestmark = pytest.mark.native

PROMPTS = [[5, 9, 2, 7], [11, 3], [8, 8, 8, 1, 4, 6]]


def test_generate_is_the_engine_and_records_a_replayable_run(tiny, tmp_path):
    llm = LLM(model="tiny", max_num_seqs=4, max_num_batched_tokens=16, trace_root=tmp_path)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16))
    want = engine.generate([{"prompt_token_ids": p, "sampling_params": params} for p in PROMPTS])
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
    assert [o.prompt_token_ids for o in outs] == [tuple(p) for p in PROMPTS]
    rows = pq.read_table(llm.trace_dir / "samples.parquet").to_pylist()
    assert len(rows) == sum(len(o.outputs[0].token_ids) for o in outs) == 18
    report = replay(llm.trace_dir, out_dir=tmp_path / "replayed")
    assert report.identical, report.summary_line()


def test_each_call_is_its_own_run_and_a_seed_does_not_depend_on_the_batch(tmp_path):
    llm = LLM(model="tiny", trace_root=tmp_path)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
    alone = llm.generate(PROMPTS[2], params)  # a single prompt (token ids)
    among = llm.generate(PROMPTS, [SamplingParams(seed=i, max_tokens=4) for i in (1, 2)] + [params])
    assert alone[0].outputs[0].token_ids == among[2].outputs[0].token_ids
    assert len(llm.trace_dirs) == 2 and llm.trace_dirs[0] != llm.trace_dirs[1] == llm.trace_dir
    other = LLM(model="tiny", trace_root=tmp_path)  # a second LLM on the same root, its first call in one second
    dirs = [other.generate(PROMPTS[2], params) and other.trace_dir for _ in range(2)] + [llm.trace_dir]
    assert len(set(dirs)) == 3  # each its own directory (the second's first call was refused: it held a run)


def test_unseeded_samples_differ_call_to_call_and_repeat_in_a_fresh_llm(tmp_path):
    """vLLM's behaviour: an unseeded request's samples differ from one call to the next (they repeated: each call's
    engine had the same seed and ids), and a fresh LLM with the same engine seed repeats them call for call; each
    call's trace replays, and every call's request ids are "0", "1", ... (two calls' traces join request by request,
    as docs/notebooks/traces_duckdb.ipynb joins them)."""
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model="tiny", trace_root=tmp_path / "a")
    calls = [llm.generate(PROMPTS, params, use_tqdm=False) for _ in range(2)]
    tokens = [[o.outputs[0].token_ids for o in outs] for outs in calls]
    assert tokens[0] != tokens[1]
    assert [o.request_id for outs in calls for o in outs] == [str(i) for i in range(len(PROMPTS))] * 2
    again = LLM(model="tiny", trace=False)
    assert [[o.outputs[0].token_ids for o in again.generate(PROMPTS, params, use_tqdm=False)] for _ in range(2)] == (
        tokens
    )
    report = replay(llm.trace_dirs[1], out_dir=tmp_path / "replayed")
    assert report.identical, report.summary_line()


def test_stop_strings_and_bad_words_up_to_their_bounds_are_taken():
    """The bounds (1024 stop strings, 4096 bad words, 65536 characters) refuse past them, not at them."""
    SamplingParams(stop=[f"s{i}" for i in range(1024)], stop_token_ids=list(range(1024)))
    SamplingParams(stop=["x" * 65536], bad_words=["b"] * 4096)


def test_without_tracing_nothing_is_written(tmp_path):
    llm = LLM(model="tiny", trace=False, trace_root=tmp_path)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and llm.trace_dir is None and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: LLM(model="tiny", max_num_seqz=4), ConfigError, "max_num_seqz"),
        (lambda: LLM(model="tiny", max_num_seqs=0), ConfigError, "max_num_seqs"),
        (lambda: LLM(model="/nonexistent/model"), Exception, "does not exist"),
        (
            lambda: LLM(model="tiny", trace=False).generate(PROMPTS, [SamplingParams()] * 2),
            ConfigError,
            "2 SamplingParams for 3",
        ),
        (lambda: LLM(model="tiny", trace=False).generate({"prompt_ids": [1]}), ConfigError, "prompt_ids"),
        (lambda: LLM(model="tiny", trace=False).generate([[1, 10**9]]), RequestError, "outside the vocabulary"),
        (lambda: LLM(model="tiny", trace=False).generate([None]), ConfigError, "a prompt is text, a list of token"),
        (lambda: LLM(model="tiny", trace=False).generate(None), ConfigError, "a prompt is text, a list of token"),
        (lambda: LLM(model="tiny", trace=False).generate(5), ConfigError, "a prompt is text, a list of token"),
        (lambda: LLM(model="tiny", trace=False).generate(np.array(5)), ConfigError, "1 dimension .* got 0"),
        (lambda: LLM(model="tiny", trace=False).generate(torch.ones(1, 2, 2)), ConfigError, "or 2 .* got 3"),
        (lambda: LLM(model="tiny", trace=False).chat("hi"), ConfigError, "messages must be a list of"),
        (lambda: LLM(model="tiny", trace=False).chat([["hi"]]), ConfigError, "a chat message is a"),
        (
            lambda: LLM(model="tiny", trace=False).chat([{"role": "user", "content": [{"type": "image_url"}]}]),
            ConfigError,
            "content parts must be text parts",
        ),
        (lambda: LLM(model="tiny", trace=False).generate("a", {"max_tokenz": 2}), ConfigError, "max_tokenz"),
        (lambda: LLM(model="tiny", trace=False).generate("a", "greedy"), ConfigError, "sampling_params must be"),
        (lambda: LLM(model="tiny", trace=False).generate("a", 5), ConfigError, "sampling_params must be"),
        (lambda: LLM(model="tiny", trace=False).generate("a", b"x"), ConfigError, "sampling_params must be"),
        (lambda: LLM(model="tiny", tensor_parallel_size=2), ConfigError, "tensor_parallel_size=2"),
        (lambda: LLM(model="tiny", gpu_memory_utilization=0.9), ConfigError, "gpu_memory_utilization"),
    ],
)
def test_bad_input_is_one_clear_error(make, error, match):
    with pytest.raises(error, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_token_ids_in_a_numpy_array_or_a_torch_tensor_are_the_lists_they_hold():
    """A prompt's ids as HF's tokenizers return them (a numpy array, a torch tensor; a row of each is one prompt,
    two rows a batch) are taken as the lists they hold: the same outputs, where they raised an untyped
    "truth value of an array is ambiguous"."""
    llm = LLM(model="tiny", trace=False)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    want = tokens(llm.generate(PROMPTS[:1] * 2, greedy))
    assert tokens(llm.generate(np.array(PROMPTS[0]), greedy)) == want[:1]
    assert tokens(llm.generate(torch.tensor(PROMPTS[0]), greedy)) == want[:1]
    assert tokens(llm.generate(torch.tensor(PROMPTS[:1] * 2), greedy)) == want
    assert tokens(llm.generate([np.array(PROMPTS[0]), torch.tensor(PROMPTS[0])], greedy)) == want
    assert tokens(llm.generate({"prompt_token_ids": np.array(PROMPTS[0])}, greedy)) == want[:1]
    # a list of numpy integers (a tokenizer's ids indexed one by one) is one prompt, not a list of prompts
    assert tokens(llm.generate([np.int64(t) for t in PROMPTS[0]], greedy)) == want[:1]
    assert tokens(llm.generate({"prompt_token_ids": [np.int32(t) for t in PROMPTS[0]]}, greedy)) == want[:1]
    with pytest.raises(RequestError, match="the prompt is empty"):  # one prompt, not none
        llm.generate(np.array([], dtype=np.int64), greedy)


def test_openai_content_parts_and_a_sampling_mapping_are_taken_as_vllm_takes_them():
    """A message's content as OpenAI's text parts is the joined text (the server's reading too), and sampling
    fields as a mapping are those SamplingParams: the same tokens either way."""
    llm = LLM(model="tiny", trace=False)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm.chat([{"role": "user", "content": "Say hi twice."}], greedy)
    parts = [{"type": "text", "text": "Say hi "}, {"type": "text", "text": "twice."}]
    joined = llm.chat([{"role": "user", "content": parts}], {"temperature": 0, "max_tokens": 4, "ignore_eos": True})
    assert joined[0].prompt_token_ids == plain[0].prompt_token_ids
    assert joined[0].outputs[0].token_ids == plain[0].outputs[0].token_ids and len(plain[0].outputs[0].token_ids) == 4
    # an assistant message as an OpenAI client dumps it (nulls beside its text), a refusal as its text: as served
    dumped = {"role": "assistant", "content": None, "refusal": "No.", "tool_calls": None, "audio": None}
    history = [{"role": "user", "content": "Say hi twice."}, dumped, {"role": "user", "content": "Why?"}]
    spelled = [*history[:1], {"role": "assistant", "content": "No."}, history[2]]
    assert llm.chat(history, greedy)[0].prompt_token_ids == llm.chat(spelled, greedy)[0].prompt_token_ids
    with pytest.raises(ConfigError, match="tool_calls is not supported"):
        llm.chat([{"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]}], greedy)


@pytest.mark.slow
def test_smollm2_chat_and_text_prompts_use_the_models_sampling_defaults(tmp_path):
    llm = LLM(model="smollm2", trace_root=tmp_path)
    assert llm.get_default_sampling_params().temperature == 0.2 and llm.model_sampling_defaults
    chat = llm.chat(
        [{"role": "user", "content": "Name a primary colour."}], SamplingParams(temperature=0, max_tokens=8)
    )
    text = llm.generate("The capital of France is")  # the model's defaults: temperature 0.2, top_p 0.9
    assert chat[0].outputs[0].text and text[0].outputs[0].text
    recorded = json.loads(read_requests(llm.trace_dir).to_pylist()[0]["sampling_params"])
    assert (recorded["temperature"], recorded["top_p"]) == (0.2, 0.9)  # resolved defaults are in the trace


@pytest.mark.parametrize("trace", [True, False])
def test_logprobs_are_vllms_and_the_traces(tmp_path, trace):
    """`logprobs=k`: per output token (of every sample) a dict of vLLM Logprobs, the sampled token first, then the
    k most likely with ranks 1..k in order; the sampled token's rank (counted on the step's logits) is its place
    among them where it is one, past k where not, 1 when greedy; its logprob is the trace's raw_logprob, and
    cumulative_logprob their sum. A request that asks for none gets None."""
    llm = LLM(model="tiny", trace=trace, trace_root=tmp_path)
    sampled = SamplingParams(temperature=1.5, seed=5, max_tokens=6, ignore_eos=True, logprobs=20, n=2)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, [sampled, greedy, SamplingParams(max_tokens=2)], use_tqdm=False)
    rows = (
        {(r["request_id"], r["stream"], r["position"]): r for r in read_samples(llm.trace_dir).to_pylist()}
        if trace
        else {}
    )
    decode = llm.get_tokenizer().decode
    for o, k in zip(outs[:2], (20, 2)):
        for c in o.outputs:
            assert len(c.logprobs) == len(c.token_ids) == (6 if k == 20 else 4)
            for j, (token, entries) in enumerate(zip(c.token_ids, c.logprobs)):
                mine = entries[token]
                assert list(entries)[0] == token and len(entries) == (k if mine.rank <= k else k + 1)
                top = sorted((e for e in entries.values() if e.rank <= k), key=lambda e: e.rank)
                assert [e.rank for e in top] == list(range(1, k + 1))
                assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:])) and top[0].logprob >= mine.logprob
                assert mine.rank == 1 or o is outs[0]
                assert mine.decoded_token == decode([token], skip_special_tokens=False)
                if trace:
                    assert mine.logprob == rows[(o.request_id, c.index, len(o.prompt_token_ids) + j)]["raw_logprob"]
            assert c.cumulative_logprob == sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs))
    assert any(e[t].rank > 20 for c in outs[0].outputs for t, e in zip(c.token_ids, c.logprobs))  # sampled off the top
    assert outs[2].outputs[0].logprobs is None and outs[2].outputs[0].cumulative_logprob is None


def test_max_tokens_none_is_the_rest_of_the_context_and_the_trace_records_it(tmp_path):
    """vLLM's SamplingParams(max_tokens=None): generate until the context is full; the engine resolves it as it
    admits the request, so the trace holds the number and the run replays."""
    llm = LLM(model="tiny", max_model_len=40, trace_root=tmp_path)
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=None, ignore_eos=True, temperature=0))
    assert [len(o.outputs[0].token_ids) for o in out] == [40 - len(p) for p in PROMPTS[:2]]
    assert {o.outputs[0].finish_reason for o in out} == {"length"}
    recorded = [json.loads(r["sampling_params"])["max_tokens"] for r in read_requests(llm.trace_dir).to_pylist()]
    assert sorted(recorded) == sorted(40 - len(p) for p in PROMPTS[:2])
    assert replay(llm.trace_dir, out_dir=tmp_path / "replayed").identical


def test_prompt_logprobs_score_each_prompt_token_as_generation_does(tmp_path):
    """vLLM's SamplingParams(prompt_logprobs=k): None for the first prompt token, then the token's Logprob (with its
    rank) and the k most likely. A token generated after a prompt, scored as part of the next prompt, gets the
    logprob its generation had."""
    llm = LLM(model="tiny", trace=False)
    first = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=2, max_tokens=1, logprobs=0), use_tqdm=False)
    longer = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, first)]
    scored = llm.generate(longer, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    for prompt, o, f in zip(longer, scored, first):
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(prompt)
        for token, entries in zip(prompt[1:], o.prompt_logprobs[1:]):
            top = sorted((e for e in entries.values() if e.rank <= 3), key=lambda e: e.rank)
            assert list(entries)[0] == token and [e.rank for e in top] == [1, 2, 3]
            assert len(entries) == (3 if entries[token].rank <= 3 else 4)
        generated = f.outputs[0].logprobs[0][prompt[-1]]
        again = o.prompt_logprobs[-1][prompt[-1]]
        # another computation (no cache, float64 softmax): the same logprob within fp32's rounding; the rank may
        # differ where another token's logit is within that rounding of this one's
        assert abs(again.logprob - generated.logprob) < 1e-4 and abs(again.rank - generated.rank) <= 2
    assert first[0].prompt_logprobs is None


def test_vllms_options_are_said_in_the_engines_terms(tmp_path):
    """A vLLM script's LLM(...) options that mean something here: one device, eager (no CUDA graphs), the swap
    space, dtype auto (a checkpoint's 16-bit torch_dtype, else float32); trust_remote_code changes nothing."""
    llm = LLM(
        model="tiny",
        trace=False,
        dtype="auto",
        tensor_parallel_size=1,
        enforce_eager=True,
        swap_space=0.5,
        trust_remote_code=True,
    )
    assert (llm.engine_cfg.cuda_graphs, llm.engine_cfg.swap_space_gb, llm.loaded.config.dtype) == (
        "off",
        0.5,
        "float32",
    )
    assert LLM(model="tiny", trace=False, enforce_eager=False).engine_cfg.cuda_graphs == "auto"
    for stored, want in (("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), (None, "float32")):
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": stored}))
        assert checkpoint_dtype(tmp_path) == want
