"""One test per row of docs/errors.md: every user mistake raises its typed error with its message."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import NATIVE_OFF, make_engine
from toolkit import replay, verify
from toolkit.config import EngineConfig, ModelConfig, SpeculativeConfig, TraceConfig, from_mapping
from toolkit.engine.core import load_for
from toolkit.errors import ConfigError, ModelLoadError, RequestError, ToolkitError, WorkloadError
from toolkit.models import load_model
from toolkit.runs.workload import load_requests
from toolkit.sampling.params import SamplingParams
from toolkit.trace.reader import TraceError, read_samples

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "errors.md").read_text()
DOC_ROWS = {int(m.group(1)) for m in re.finditer(r"^\| (\d+) \|", DOC, re.M)}


def _expect(row: int, exc_type, message: str, fn) -> None:
    assert row in DOC_ROWS, f"docs/errors.md has no row {row}"
    with pytest.raises(exc_type) as info:
        fn()
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text  # one line
    if issubclass(exc_type, ToolkitError):
        assert isinstance(info.value, ToolkitError)


SAMPLING_CASES = [
    (5, dict(temperature=-1), "temperature must be 0 (greedy) or a number in [1e-05, 1e+05]"),
    (5, dict(temperature=1e-38), "temperature must be 0 (greedy)"),  # 1 / t overflows fp32: logits of +inf
    (5, dict(temperature=float("inf")), "temperature must be 0 (greedy)"),
    (6, dict(top_p=0.0), "top_p must be in (0, 1]"),
    (6, dict(top_p=1.5), "top_p must be in (0, 1]"),
    (7, dict(top_k=-2), "top_k must be -1"),
    (8, dict(min_p=2.0), "min_p must be in [0, 1]"),
    (9, dict(repetition_penalty=0.0), "repetition_penalty must be >= 1e-05"),
    (9, dict(repetition_penalty=1e-300), "repetition_penalty must be >= 1e-05"),
    (10, dict(n=0), "n must be an integer >= 1"),
    (11, dict(max_tokens=0), "max_tokens must be a positive integer"),
    (12, dict(stop=["ok", ""]), "stop strings must not be empty"),
    (14, dict(logprobs=50), "logprobs must be null or an integer in [0, 20]"),
    (48, dict(logit_bias={5: float("inf")}), "values numbers <= 1e+05"),
    (48, dict(logit_bias={5: float("nan")}), "values numbers <= 1e+05"),
    (48, dict(logit_bias={5: 1e6}), "values numbers <= 1e+05"),
    (49, dict(stop=["ok", "a\ud800"]), "stop string 'a\\ud800': it holds a lone surrogate"),
    (49, dict(bad_words=["\udfff"]), "bad_words entry '\\udfff': it holds a lone surrogate"),
    (80, dict(stop=["x"] * 2000), "stop holds 2000 strings, more than the 1024 one request may give"),
    (80, dict(stop=["x" * 65537]), "stop holds 65537 characters, more than the 65536"),
    (80, dict(stop_token_ids=[2] * 1025), "stop_token_ids holds 1025 token ids, more than the 1024"),
    (80, dict(bad_words=["a"] * 4097), "bad_words holds 4097 entries, more than the 4096"),
    (80, dict(bad_words=[[1] * 65537]), "bad_words holds 65537 characters and token ids, more than the 65536"),
    (
        21,
        dict(structured_outputs={"json": {}, "regex": "a"}),
        "structured_outputs needs exactly one of json, regex, grammar, choice",
    ),
]


@pytest.mark.parametrize("row,kwargs,message", SAMPLING_CASES)
def test_sampling_params_out_of_range(row, kwargs, message):
    _expect(row, ConfigError, message, lambda: SamplingParams(**kwargs))


def test_config_rows():
    _expect(
        1,
        ConfigError,
        "unknown engine option(s) max_num_seq; known:",
        lambda: from_mapping(EngineConfig, {"max_num_seq": 3}, section="engine"),
    )
    _expect(
        3,
        ConfigError,
        "engine.max_num_batched_tokens must be a positive integer, got 0",
        lambda: EngineConfig(max_num_batched_tokens=0),
    )
    _expect(4, ConfigError, "must be >= engine.max_num_seqs", lambda: EngineConfig(max_num_batched_tokens=8))
    _expect(
        13,
        ConfigError,
        "unknown sampling option(s) temprature",
        lambda: SamplingParams.from_mapping({"temprature": 1.0}),
    )
    _expect(23, ConfigError, "speculative.method must be one of", lambda: SpeculativeConfig(method="medusa"))
    _expect(
        3,
        ConfigError,
        "engine.kv_cache_memory_gb must be a finite positive number, got inf",
        lambda: EngineConfig(kv_cache_memory_gb=float("inf")),
    )
    for bad, message in [
        ({"flush_every_steps": 0}, "trace.flush_every_steps must be an integer in [1, 64], got 0"),
        ({"flush_every_steps": 1000}, "trace.flush_every_steps must be an integer in [1, 64], got 1000"),
        ({"enabled": "maybe"}, "trace.enabled must be true or false, got 'maybe'"),
    ]:
        _expect(53, ConfigError, message, lambda: from_mapping(TraceConfig, bad, section="trace"))


def test_a_device_or_kv_memory_this_machine_has_not_is_refused_before_the_model_loads():
    """Before: engine.device=mps passed the config and torch failed on the weights; a kv_cache_memory_gb past the
    machine's memory got the process killed as the pool filled."""
    tiny = ModelConfig(name="tiny")
    if not torch.backends.mps.is_available():
        _expect(
            51,
            ConfigError,
            "engine.device=mps but this torch build cannot use MPS",
            lambda: load_for(tiny, EngineConfig(device="mps"), {}),
        )
    _expect(
        52,
        ConfigError,
        "engine.kv_cache_memory_gb=1e+09 is more than the",
        lambda: load_for(tiny, EngineConfig(kv_cache_memory_gb=1e9), {}),
    )
    load_for(tiny, EngineConfig(kv_cache_memory_gb=1e9, num_kv_blocks=8), {})  # a fixed pool does not read it


@pytest.mark.native
def test_a_kv_pool_of_blocks_or_a_swap_pool_larger_than_memory_is_refused(tiny):
    """engine.num_kv_blocks and engine.swap_space_gb size their pools directly: past the memory they live in, the
    allocator's traceback (or an overflow in torch's size arithmetic) was the answer."""
    from toolkit.engine.core import Engine

    loaded = tiny
    for cfg, message in (
        (EngineConfig(num_kv_blocks=10**9), "engine.num_kv_blocks=1e+09 makes a KV pool of"),
        (EngineConfig(preemption_mode="swap", swap_space_gb=1e12), "engine.swap_space_gb=1e+12 makes a KV pool of"),
        # a pool sized automatically (num_kv_blocks unset) of one block past the memory: the block size is why
        (EngineConfig(block_size=2**31), "engine.block_size=2.14748e+09 makes a KV pool of"),
    ):
        _expect(59, ConfigError, message, lambda cfg=cfg: Engine(loaded, cfg))
    from toolkit.kv.paged_cache import PagedKVCache

    ram_gb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    layers, kv_heads, head_dim = loaded.model.kv_shape
    block_gb = (
        PagedKVCache.block_bytes(layers, EngineConfig().block_size, kv_heads, head_dim, torch.float32, "auto", "block")
        / 2**30
    )
    half = EngineConfig(num_kv_blocks=int(0.6 * ram_gb / block_gb), preemption_mode="swap", swap_space_gb=0.6 * ram_gb)
    _expect(59, ConfigError, "make KV pools of", lambda: Engine(loaded, half))  # each fits, the two do not


def test_cli_typo_and_mistyped_value_are_refused_by_composition(tmp_path):
    assert 2 in DOC_ROWS
    for override, message in [
        ("engine.max_num_seq=3", "Could not override 'engine.max_num_seq'"),
        ("engine.max_num_seqs=many", "could not be converted to Integer"),
    ]:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "run.py"), "model=tiny", override, f"hydra.run.dir={tmp_path}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.native
def test_request_rows(tiny):
    engine = make_engine(tiny, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=16)
    _expect(15, RequestError, "the prompt is empty", lambda: engine.add_request(prompt=""))
    _expect(16, RequestError, "is outside the vocabulary", lambda: engine.add_request(prompt_token_ids=[1, 10**7]))
    _expect(
        17,
        RequestError,
        "engine.max_model_len); shorten the prompt",
        lambda: engine.add_request(prompt_token_ids=[1] * 5000),
    )
    _expect(
        18,
        RequestError,
        "can never fit the KV pool",
        lambda: engine.add_request(prompt_token_ids=[1] * 200, sampling_params=SamplingParams(max_tokens=100)),
    )
    _expect(
        19,
        RequestError,
        "give exactly one of prompt, messages or prompt_token_ids",
        lambda: engine.add_request(prompt="a", messages=[{"role": "user", "content": "a"}]),
    )
    _expect(50, RequestError, "prompt: it holds a lone surrogate", lambda: engine.add_request(prompt="hi \ud83d"))
    _expect(
        50,
        RequestError,
        "messages.0.content: it holds a lone surrogate '\\udc00' at character 0",
        lambda: engine.add_request(messages=[{"role": "user", "content": "\udc00"}]),
    )
    _expect(
        50,
        RequestError,
        "request id 'a\\ud800': it holds a lone surrogate",
        lambda: engine.add_request(prompt="hi", request_id="a\ud800"),
    )
    _expect(
        54,
        RequestError,
        "priority must be an integer in [-2^63, 2^63), got 100000000000000000000000000000",
        lambda: engine.add_request(prompt="hi", priority=10**29),
    )
    _expect(
        54,
        RequestError,
        "arrival_step must be an integer in [0, 2^63), got 9223372036854775808",
        lambda: engine.add_request(prompt="hi", arrival_step=2**63),
    )
    engine.add_request(prompt="a", request_id="dup")
    _expect(20, RequestError, "is already in use", lambda: engine.add_request(prompt="b", request_id="dup"))
    for spec, kind in [
        ({"regex": "(("}, "regex"),
        ({"json": {"type": "nonsense"}}, "json"),
        ({"grammar": "root ::= ("}, "grammar"),
    ]:
        _expect(
            22,
            RequestError,
            f"invalid structured_outputs.{kind}:",
            lambda: engine.add_request(prompt="a", sampling_params=SamplingParams(structured_outputs=spec)),
        )
    # a refused request leaves the engine serving the others
    outs = engine.generate([{"prompt": "hello", "sampling_params": SamplingParams(max_tokens=3, ignore_eos=True)}])
    assert len(outs[0].output_token_ids) == 3


@pytest.mark.native
def test_rows_of_a_model_without_a_tokenizer_or_with_one_layer():
    """Found by a probe: a model without a tokenizer took stop strings and never stopped on them (bad words and
    grammars were refused already), a one-layer model's self-draft named an empty range, and an array of ids
    raised numpy's or torch's own ValueError."""
    import numpy as np

    from tests.families import checkpoint_dir
    from toolkit import LLM
    from toolkit.bench.host_step import SHAPE
    from toolkit.engine.core import Engine

    untokenized = load_model(ModelConfig(name="hf", path=str(checkpoint_dir("llama"))))
    engine = make_engine(untokenized)
    stop = SamplingParams(stop=["x"], max_tokens=4)
    add = engine.add_request
    _expect(
        63, RequestError, "stop strings need a tokenizer", lambda: add(prompt_token_ids=[2, 3], sampling_params=stop)
    )
    assert add(prompt_token_ids=[2, 3], sampling_params=SamplingParams(stop_token_ids=[5], max_tokens=4))
    one_layer = load_model(ModelConfig(**SHAPE))
    self_draft = SpeculativeConfig(method="self_draft", draft_layers=1)
    _expect(64, ConfigError, "it needs 2 or more", lambda: Engine(one_layer, EngineConfig(), speculative=self_draft))
    llm = LLM(model="tiny", trace=False)
    _expect(65, ConfigError, "or 2 (prompts), got 3", lambda: llm.generate(np.zeros((1, 1, 2), dtype=np.int64)))


def test_model_rows(tmp_path):
    _expect(
        24,
        ModelLoadError,
        "does not exist or is not a directory",
        lambda: load_model(ModelConfig(name="hf", path=str(tmp_path / "nope"))),
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _expect(
        25, ModelLoadError, "has no *.safetensors weights", lambda: load_model(ModelConfig(name="hf", path=str(empty)))
    )
    from toolkit.models.loading import smollm2_dir

    model = tmp_path / "truncated"
    shutil.copytree(smollm2_dir(), model)
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:4096])
    _expect(26, ModelLoadError, "(truncated or corrupt?)", lambda: load_model(ModelConfig(name="hf", path=str(model))))


def test_family_and_training_rows(tmp_path, tiny):
    from tests.families import checkpoint_dir
    from toolkit.bench.kv_quantization import parse_variant
    from toolkit.modes.train import train

    foreign = tmp_path / "mamba"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "mamba", "vocab_size": 8}))
    (foreign / "model.safetensors").write_bytes(b"")
    _expect(
        39,
        ModelLoadError,
        "unsupported model_type 'mamba'; supported: llama, mistral, qwen2, qwen3, gpt2, gemma2",
        lambda: load_model(ModelConfig(name="hf", path=str(foreign))),
    )
    from safetensors.torch import load_file, save_file

    qwen = tmp_path / "qwen2"
    shutil.copytree(checkpoint_dir("qwen2"), qwen)
    weights = load_file(str(qwen / "model.safetensors"))
    del weights["model.layers.0.self_attn.q_proj.bias"]
    save_file(weights, str(qwen / "model.safetensors"))
    _expect(
        40,
        ModelLoadError,
        "checkpoint is missing tensor model.layers.0.self_attn.q_proj.bias",
        lambda: load_model(ModelConfig(name="hf", path=str(qwen))),
    )
    _expect(
        41,
        ModelLoadError,
        "model=nanogpt needs model.path=<checkpoint dir written by mode=train>",
        lambda: load_model(ModelConfig(name="nanogpt")),
    )
    _expect(
        42,
        ConfigError,
        "train.text must name a local text file",
        lambda: train({"text": str(tmp_path / "none.txt")}, {}, tmp_path / "out"),
    )
    _expect(43, ConfigError, "engine.kv_cache_dtype must be one of", lambda: EngineConfig(kv_cache_dtype="int4"))
    _expect(
        44,
        ConfigError,
        "engine.batch_invariant=true needs the fp32 cache of the native kernel",
        lambda: EngineConfig(kv_cache_dtype="int8", batch_invariant=True),
    )
    _expect(
        45,
        ConfigError,
        "engine.attention_backend=flex reads the cache as stored",
        lambda: make_engine(tiny, kv_cache_dtype="int8", attention_backend="flex"),
    )
    assert (
        46 in DOC_ROWS
    )  # tests/test_kv_quant.py::test_quantised_run_replays_bit_for_bit_through_swap_and_prefix_caching
    _expect(47, ConfigError, "kv_quantization.variants: bad variant 'int4'", lambda: parse_variant("int4"))


def test_truncated_gguf_is_a_model_load_error(tmp_path, monkeypatch):
    from toolkit.models import loading

    gguf = tmp_path / "wheel" / loading.SMOLLM2_GGUF
    gguf.parent.mkdir()
    data = loading.smollm2_gguf().read_bytes()
    gguf.write_bytes(data[: len(data) // 4])
    monkeypatch.setattr(loading, "smollm2_gguf", lambda: gguf)
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    _expect(
        27, ModelLoadError, "(truncated or corrupt? reinstall with pip install --force-reinstall", loading.smollm2_dir
    )
    assert not any((tmp_path / "cache").glob("smollm2*"))  # no half-written cache left behind


@pytest.mark.native
def test_requests_file_rows(tmp_path, tiny):
    from toolkit.runs.workload import add_specs

    _expect(28, WorkloadError, "does not exist", lambda: load_requests(tmp_path / "missing.jsonl"))
    path = tmp_path / "reqs.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": \n{"prompt": "x", "max_tokens": -1}\n')
    specs, rejected = load_requests(path)
    assert 29 in DOC_ROWS and len(rejected) == 1
    assert "line 2" in rejected[0].reason and "malformed JSON" in rejected[0].reason
    ids, refused = add_specs(make_engine(tiny), specs)  # the bad field is refused, the good line runs
    assert 30 in DOC_ROWS and len(ids) == 1 and len(refused) == 1
    assert "line 3" in refused[0].reason and "max_tokens" in refused[0].reason
    # the fields the trace stores in fixed-width columns, and an id no UTF-8 file holds: that line's error
    path.write_text(
        '{"prompt": "fine"}\n{"prompt": "hi", "priority": 100000000000000000000000000000}\n'
        '{"prompt": "hi", "arrival_step": 100000000000000000000}\n{"id": "a\\ud800", "prompt": "hi"}\n'
    )
    specs, rejected = load_requests(path)
    ids, refused = add_specs(make_engine(tiny), specs)
    assert not rejected and len(ids) == 1, refused
    assert [r.reason.split(": ")[:2] for r in refused] == [
        ["reqs.jsonl line 2", "priority must be an integer in [-2^63, 2^63), got 100000000000000000000000000000"],
        ["reqs.jsonl line 3", "arrival_step must be an integer in [0, 2^63), got 100000000000000000000"],
        ["reqs.jsonl line 4", "request id 'a\\ud800'"],
    ]


def test_a_requests_line_past_what_python_reads_is_malformed_json(tmp_path):
    """A line nested past Python's recursion limit, or holding an integer of more digits than int() converts, is
    that line's error (they raised RecursionError and ValueError out of load_requests); the others are read."""
    path = tmp_path / "reqs.jsonl"
    path.write_text(
        "[" * 100000 + "]" * 100000 + '\n{"prompt": "hi", "max_tokens": ' + "9" * 5000 + '}\n{"prompt": "ok"}\n'
    )
    specs, rejected = load_requests(path)
    assert 29 in DOC_ROWS and [s.prompt for s in specs] == ["ok"]
    assert [r.reason for r in rejected] == [
        "reqs.jsonl line 1: malformed JSON (nested too deep to read)",
        "reqs.jsonl line 2: malformed JSON (a number of more than 4300 digits)",
    ]
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')  # Latin-1
    _expect(28, WorkloadError, "reqs.jsonl' line 2 is not UTF-8 text (its byte 16, 0xe9)", lambda: load_requests(path))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, tiny):
    from toolkit.runs.session import record

    run = tmp_path_factory.mktemp("errors") / "run"
    engine = make_engine(tiny, max_num_seqs=2, max_num_batched_tokens=32)
    ids = [engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=4, seed=1))]
    record(
        engine,
        ids,
        run,
        {"model": {"name": "tiny", "seed": 0}, "engine": {"max_num_seqs": 2, "max_num_batched_tokens": 32}},
    )
    return run


@pytest.mark.native
def test_trace_rows(small_run, tmp_path):
    _expect(31, TraceError, "does not exist", lambda: replay(tmp_path / "nope"))
    _expect(31, TraceError, "does not exist", lambda: verify(tmp_path / "nope"))
    other = tmp_path / "other_version"
    shutil.copytree(small_run, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["schema_version"] = 999
    (other / "manifest.json").write_text(json.dumps(manifest))
    _expect(32, TraceError, "schema version", lambda: replay(other))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(small_run, corrupt)
    part = next((corrupt / "samples.parquet").glob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[:100])
    _expect(33, TraceError, "is truncated or corrupt", lambda: read_samples(corrupt))
    _expect(
        34,
        TraceError,
        "refusing to replay: model weights differ",
        lambda: replay(small_run, ["model.seed=1"], out_dir=tmp_path / "r34"),
    )
    _expect(
        35,
        *(
            (ConfigError, "engine.batch_invariant=true is unavailable here")
            if NATIVE_OFF
            # no kernels
            else (TraceError, "engine.batch_invariant differs")
        ),
        lambda: replay(small_run, ["+engine.batch_invariant=true"], out_dir=tmp_path / "r35"),
    )
    _expect(
        36,
        ConfigError,
        "needs a trace recorded with engine.batch_invariant=true",
        lambda: verify(small_run, reference="exact"),
    )
    from toolkit.reproduce.compare import compare

    _expect(37, ConfigError, "matches no run directory", lambda: compare([str(tmp_path / "none*")]))
    assert (
        38 in DOC_ROWS
    )  # Ctrl-C, SIGTERM: tests/test_cli.py::test_ctrl_c_or_sigterm_flushes_the_trace_writes_the_summary_and_exits_as_the_signal
    # and in a soak: tests/test_soak_and_fuzz.py::test_ctrl_c_stops_the_soak_between_steps_with_its_trace_and_report
    # tests/test_replay_verify.py::test_a_trace_that_cannot_be_trusted_is_refused_naming_what: rows 55 and 56 there,
    # tests/test_trace.py::test_a_run_directory_that_cannot_be_written_is_one_line_before_any_step: row 57,
    # tests/test_serve_hostile.py::test_a_hostile_request_is_a_4xx_naming_its_field_and_costs_nothing: row 58
    assert {55, 56, 57, 58} <= DOC_ROWS


@pytest.mark.native
def test_replay_overrides_the_trace_fixes_held_out_shapes_and_alternatives_past_the_vocabulary():
    from toolkit.models.families import arch_from_hf_config
    from toolkit.reproduce.replay import check_overrides

    for override in (
        "sampling.temperature=0.3",
        "+sampling.top_k=3",
        "+processors=x",
        "workload.num_requests=1",
        "engine.seed=7",
    ):
        _expect(60, ConfigError, "cannot change a replay", lambda o=override: check_overrides([o]))
    check_overrides(["engine.max_num_seqs=2", "engine.seed_offset=1", "model.dtype=bfloat16"])  # these reach it
    llama = {"model_type": "llama", "vocab_size": 64, "hidden_size": 96, "num_hidden_layers": 1}
    heads = {**llama, "intermediate_size": 64, "num_attention_heads": 6, "num_key_value_heads": 4}
    _expect(61, ModelLoadError, "must be a multiple of num_key_value_heads", lambda: arch_from_hf_config(heads))
    engine = make_engine(load_model(ModelConfig(name="tiny", seed=1, vocab_size=17)))
    for name in ("logprobs", "prompt_logprobs"):
        _expect(
            62,
            RequestError,
            "asks for more alternatives than the vocabulary's 17 tokens",
            lambda n=name: engine.add_request(prompt_token_ids=[1], sampling_params={n: 20}),
        )


def test_every_documented_row_is_tested():
    source = Path(__file__).read_text()
    tested = {int(n) for n in re.findall(r"_expect\(\s*(\d+),", source)}
    tested |= {int(n) for n in re.findall(r"(\d+) in DOC_ROWS", source)}
    tested |= {int(n) for ns in re.findall(r"\{([\d, ]+)\} <= DOC_ROWS", source) for n in ns.split(",")}
    tested |= {row for row, _, _ in SAMPLING_CASES}
    assert DOC_ROWS <= tested, sorted(DOC_ROWS - tested)


def test_the_run_directory_serve_address_and_trace_files_a_probe_broke_are_one_line(tmp_path):
    """Rows 66-74, added after the twenty-fifth session's hostile probes: each called where it is raised, or named
    beside the test that drives it end to end."""
    from toolkit.reproduce.replay import replay
    from toolkit.serve.connections import listening_socket
    from toolkit.trace.reader import read_config, read_summary

    _expect(
        66,
        ConfigError,
        "serve.host=256.1.1.1 serve.port=8000: cannot listen there: ",
        lambda: listening_socket("256.1.1.1", 8000),
    )
    (tmp_path / "config.yaml").write_text("")
    _expect(67, TraceError, "is not a run's config: it has no model or engine section", lambda: read_config(tmp_path))
    _expect(69, ConfigError, "replay.overrides must be a list of key=value strings", lambda: replay(tmp_path, 5))
    _expect(
        69,
        ConfigError,
        "replay.allow_mismatch must be true or false",
        lambda: replay(tmp_path, [], allow_mismatch="false"),
    )
    (tmp_path / "summary.json").write_text("x")
    _expect(70, TraceError, "summary.json is unreadable or corrupt", lambda: read_summary(tmp_path))
    (tmp_path / "summary.json").write_text('{"interrupted": true, "output_tok_per_s": "fast"}')
    _expect(70, TraceError, "is corrupt: output_tok_per_s is 'fast', not a number", lambda: read_summary(tmp_path))
    # tests/test_replay_verify.py: test_a_manifests_thread_count_out_of_range_is_refused_not_set (68),
    # test_a_sample_rows_policy_other_than_its_requests_is_refused (71),
    # test_a_trace_without_sample_rows_is_nothing_to_check_not_a_success (72);
    # tests/test_serve_hardening.py::test_echo_scoring_past_max_scored_tokens_is_a_400_before_any_forward (73);
    # tests/test_serve_shutdown.py::test_a_shutdown_answers_the_requests_being_prepared_at_once_and_stops_their_work (74)
    assert {68, 71, 72, 73, 74} <= DOC_ROWS
    from toolkit.sampling.structured import StructuredOutputs

    outside = {"properties": {"a": {"$ref": "https://example.com/a.json"}}, "$defs": {"b": {"$ref": "#/$defs/b"}}}
    _expect(75, ConfigError, "points outside the schema", lambda: StructuredOutputs(json=outside))
    assert StructuredOutputs(json={"$defs": {"b": {"type": "string"}}, "$ref": "#/$defs/b"}).kind == "json"
    unique = {
        "type": "object",
        "properties": {"not": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
    }
    message = "'uniqueItems' at properties.not.uniqueItems is not enforced by the grammar engine (xgrammar)"
    _expect(81, ConfigError, message, lambda: StructuredOutputs(json=unique))
    deep = '{"items":' * 5000 + "{}" + "}" * 5000  # a RecursionError before
    _expect(81, ConfigError, "nested too deeply to be read", lambda: StructuredOutputs(json=deep))
    # tests/test_grammar.py::test_a_keyword_xgrammar_does_not_enforce_is_refused_naming_its_path: every keyword (81)
    assert 76 in DOC_ROWS  # tests/test_serve.py::test_a_bad_request_is_a_4xx_naming_the_field: messages.0.content
    # tests/test_serve_hostile.py: test_a_compile_past_its_time_limit_is_killed_and_its_thread_free_at_once,
    # test_a_grammar_past_its_memory_bound_is_a_400_naming_the_knob, test_a_compiling_child_that_dies_is_one_400 (83)
    assert 83 in DOC_ROWS
    assert 77 in DOC_ROWS  # tests/test_run_faults.py::test_full_logits_naming_a_request_the_run_has_not_is_one_line
    from toolkit.errors import ClusterError
    from toolkit.reproduce.shard import check_reachable

    _expect(78, ClusterError, "no Ray cluster answers there", lambda: check_reachable("127.0.0.1:1", "verify"))
    from toolkit.bench.kv_quantization import kv_quantization_options
    from toolkit.bench.scheduling import scheduling_options

    plot = {"variants": {"a": {"max_num_seqs": 2}}, "plot_y": ["bogus"]}  # a zero-height bar before
    _expect(79, ConfigError, "scheduling.plot_y: unknown figure", lambda: scheduling_options(plot, EngineConfig()))
    twice = {"variants": ["int8", "int8"]}
    _expect(79, ConfigError, "kv_quantization.variants names 'int8' twice", lambda: kv_quantization_options(twice))
    from toolkit.runs.loggers import check_logger

    wandb = {"backend": "wandb", "mode": "offline"}
    _expect(
        82, ConfigError, "logger.project='a/b': Invalid project name", lambda: check_logger({**wandb, "project": "a/b"})
    )
    message = "logger=wandb logs mode=run only; mode=serve would ignore it"
    _expect(82, ConfigError, message, lambda: check_logger(wandb, "serve"))
    _expect(
        88,
        ConfigError,
        "engine.scheduling_policy must be fcfs, priority or null",
        lambda: EngineConfig(scheduling_policy="lifo"),
    )
    # tests/test_engine_api.py::test_allowed_tokens_that_are_all_banned_are_refused_at_intake (84); the HOSTILE rows
    # "64 prompts times n" and "a bias past OpenAI's range..." (85); tests/test_serve_hardening.py::
    # test_echo_scoring_past_max_scoring_is_a_503_at_once_and_runs_below_the_engines_priority (86);
    # tests/test_serve_hostile.py::test_a_compressed_body_is_a_415_naming_its_encoding (87)
    assert {84, 85, 86, 87} <= DOC_ROWS
