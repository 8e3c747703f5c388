"""The suite's 30-second soak (the 10-minute one is `python run.py experiment=soak`), and
hypothesis fuzzing of sampling parameters, engine configs and request files: each input either
runs or fails with its documented error type, never crashes the engine or corrupts a trace."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_engine, once
from toolkit.config import EngineConfig, from_mapping
from toolkit.errors import ConfigError, RequestError, WorkloadError
from toolkit.modes.soak import soak
from toolkit.sampling.params import SamplingParams
from toolkit.trace.reader import read_samples

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.native
@once
def test_thirty_second_soak(tiny, tmp_path):
    cfg = EngineConfig(
        num_kv_blocks=96,
        block_size=16,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        preemption_mode="swap",
        swap_space_gb=0.05,
    )
    report = soak(tiny, cfg, tmp_path, duration_s=30, warmup_s=10, seed=1)
    assert report["passed"], report["problems"]
    assert report["added"] > 50 and report["aborted"] > 0 and report["finished"] > 0
    assert report["preemptions"] > 0  # the pool is small enough to preempt
    assert read_samples(tmp_path).num_rows == report["trace_rows"] == report["sample_rows"]


@pytest.mark.native
def test_ctrl_c_stops_the_soak_between_steps_with_its_trace_and_report(tmp_path):
    """Ctrl-C during `python run.py experiment=soak`: stopped between steps, the trace writer closed (the rows of
    the steps since its last flush on disk too), soak.json written with what was measured and `interrupted`, exit
    130 with one line. Before, the KeyboardInterrupt left the loop mid-step: no soak.json, the unflushed rows
    (up to 63 steps') lost, and SIGTERM killed it outright."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), "experiment=soak", "soak.duration_s=600", "soak.warmup_s=0"]
        + [f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a suite in the background ignores it
    )
    deadline = time.time() + 180
    while not list((run_dir / "samples.parquet").glob("part-*.parquet")) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # some steps past the writer's flush (every 64 steps): rows that only close() writes
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: soak interrupted after") and "(SIGINT)" in lines[0], err
    assert "Traceback" not in err
    report = json.loads((run_dir / "soak.json").read_text())
    assert report["interrupted"] is True and report["signal"] == "SIGINT" and report["passed"] is False
    assert report["steps"] > 64 and report["problems"] == [], report
    assert read_samples(run_dir).num_rows == report["trace_rows"] == report["sample_rows"] > 0


NUMBERS = st.one_of(
    st.integers(-5, 100),
    st.floats(-2, 3),
    st.sampled_from([float("nan"), float("inf"), -1e30]),
    st.none(),
    st.text(max_size=3),
    st.booleans(),
)
SAMPLING_KEYS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "max_tokens",
    "min_tokens",
    "seed",
    "logprobs",
    "no_repeat_ngram_size",
]


@settings(max_examples=300)
@given(
    st.dictionaries(
        st.sampled_from(SAMPLING_KEYS + ["stop", "bad_words", "temprature"]),
        st.one_of(NUMBERS, st.lists(st.text(max_size=3), max_size=2)),
        max_size=4,
    )
)
def test_fuzzed_sampling_params_are_valid_or_a_config_error(data):
    try:
        SamplingParams.from_mapping(data)
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc)


ENGINE_KEYS = [
    "block_size",
    "num_kv_blocks",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "seed",
    "num_threads",
    "kv_cache_memory_gb",
    "swap_space_gb",
    "attention_backend",
    "preemption_mode",
    "enable_prefix_caching",
    "batch_invariant",
    "device",
]


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(ENGINE_KEYS), NUMBERS, max_size=4))
def test_fuzzed_engine_configs_are_valid_or_a_config_error(data):
    try:
        from_mapping(EngineConfig, data, section="engine")
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc)


LINE = st.one_of(
    st.text(max_size=30),  # not JSON
    st.dictionaries(
        st.sampled_from(
            ["prompt", "messages", "prompt_token_ids", "max_tokens", "arrival_step", "id", "sampling", "priority"]
        ),
        st.one_of(
            NUMBERS,
            st.text(max_size=8),
            st.lists(st.integers(-3, 60000), max_size=5),
            st.dictionaries(st.sampled_from(SAMPLING_KEYS), NUMBERS, max_size=2),
        ),
        max_size=4,
    ).map(json.dumps),
)


@pytest.mark.native
@settings(max_examples=60)
@given(st.lists(LINE, min_size=1, max_size=6))
def test_fuzzed_request_files_never_crash_the_engine_or_the_trace(tiny, tmp_path_factory, lines):
    from toolkit.runs.session import record
    from toolkit.runs.workload import add_specs, load_requests

    run = tmp_path_factory.mktemp("fuzz")
    path = run / "reqs.jsonl"
    path.write_text("\n".join(line.replace("\n", " ") for line in lines) + "\n")
    try:
        specs, rejected = load_requests(path)
    except WorkloadError as exc:  # e.g. a file with no request at all: the documented error
        assert "\n" not in str(exc)
        return
    engine = make_engine(tiny, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64)
    for spec in specs:  # a bad spec must be refused with a typed error, never anything else
        try:
            engine.add(spec.engine_request())
        except (RequestError, ConfigError) as exc:
            assert "\n" not in str(exc)
    engine = make_engine(tiny, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64)
    ids, refused = add_specs(engine, specs)
    assert len(ids) + len(refused) == len(specs) and all("line" in r.reason for r in rejected + refused)
    recorded = record(engine, ids, run / "run", {"model": {"name": "tiny", "seed": 0}})
    rows = read_samples(run / "run").num_rows
    assert rows == recorded.summary["trace_rows"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# what str.splitlines() takes for a line break besides \n; JSON strings may hold the last three raw
BREAKS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
BOM = "\ufeff"


def test_a_requests_file_is_read_line_by_line_as_its_lines_are_numbered(tmp_path):
    """load_requests read the file as text and cut it with str.splitlines(): a raw U+2028 or U+0085 inside a JSON
    string (valid JSON, json.dumps(ensure_ascii=False) writes them) split the line in two, both rejected, and every
    later line got a number one too high; a UTF-8 byte order mark made line 1 malformed JSON. Lines now end at \\n
    (a \\r before it dropped), a BOM at the start of the file is dropped, and a file that is no UTF-8 is one
    WorkloadError naming the line."""
    from toolkit.runs.workload import load_requests

    path = tmp_path / "reqs.jsonl"
    lines = [
        BOM + '{"id": "bom", "prompt": "hello"}',
        '{"id": "ls", "prompt": "a\u2028b"}',
        '{"id": "nel", "prompt": "a\x85b\u2029c"}\r',
        "",
        '{"id": "plain", "prompt": "fine"}\r',
        BOM + '{"id": "late-bom", "prompt": "x"}',
        '{"prompt": "a", "max_tokens": }',
    ]
    path.write_bytes("\n".join(lines).encode())
    specs, rejected = load_requests(path)
    assert [(s.id, s.prompt, s.source) for s in specs] == [
        ("bom", "hello", "reqs.jsonl line 1"),
        ("ls", "a\u2028b", "reqs.jsonl line 2"),
        ("nel", "a\x85b\u2029c", "reqs.jsonl line 3"),
        ("plain", "fine", "reqs.jsonl line 5"),
    ]
    assert [r.source for r in rejected] == ["reqs.jsonl line 6", "reqs.jsonl line 7"], rejected  # only one BOM
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')  # Latin-1
    with pytest.raises(WorkloadError, match=r"line 2 is not UTF-8 text \(its byte 16, 0xe9\)") as info:
        load_requests(path)
    assert "\n" not in str(info.value)


PROMPT_TEXT = st.text(st.characters(codec="utf-8") | st.sampled_from([*BREAKS, BOM]), max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.none() | PROMPT_TEXT, min_size=1, max_size=8).filter(lambda e: any(p is not None for p in e)),
    st.booleans(),
    st.sampled_from(["\n", "\r\n"]),
    st.booleans(),
)
def test_any_prompts_written_as_jsonl_load_back_as_written(tmp_path_factory, prompts, bom, newline, last_newline):
    """Requests whose prompts hold any text (line and paragraph separators, NEL, a BOM, ...), one JSON object a line
    (None: a blank line) with \\n or \\r\\n endings, a BOM at the start of the file or not: each loads back as
    written, its default id naming the line it is on in the file (blank lines counted)."""
    from toolkit.runs.workload import load_requests

    lines = ["" if p is None else json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts]
    text = (BOM if bom else "") + newline.join(lines) + (newline if last_newline else "")
    path = tmp_path_factory.mktemp("requests") / "reqs.jsonl"
    path.write_bytes(text.encode())
    specs, rejected = load_requests(path)
    assert not rejected, rejected
    want = [(f"line-{n}", p) for n, p in enumerate(prompts, start=1) if p is not None]
    assert [(s.id, s.prompt) for s in specs] == want


@pytest.mark.parametrize(
    ("over", "options", "named"),
    [  # each crashed with a traceback before (a helper's probe): now one ConfigError naming the option
        ("engine", {"duration_s": "abc"}, "soak.duration_s"),  # TypeError: '<' not supported
        ("engine", {"duration_s": -5}, "soak.duration_s"),  # a soak of nothing that reported success
        ("engine", {"duration_s": float("inf")}, "soak.duration_s"),  # a soak without end
        ("engine", {"duration_s": 1, "check_every": 0}, "soak.check_every"),  # ZeroDivisionError
        ("engine", {"duration_s": 1, "max_prompt": 0}, "soak.max_prompt"),  # empty range for randrange()
        ("engine", {"duration_s": 1, "max_new": 0}, "soak.max_new"),
        ("engine", {"duration_s": 1, "queue_depth": 0}, "soak.queue_depth"),  # 105,968 empty steps
        ("engine", {"duration_s": 1, "queue_depth": 20000}, "soak.queue_depth"),  # 18 s for one step
        ("engine", {"queue_depth": 8}, "soak.duration_s is required"),  # TypeError: missing duration_s
        ("http", {"report_every": 0}, "soak.report_every"),  # ZeroDivisionError
        ("http", {"concurrency": 0}, "soak.concurrency"),
        ("http", {"requests": -3}, "soak.requests"),
        ("http", {"burst": 10**6}, "soak.burst"),
        ("http", {"replay": "yes"}, "soak.replay"),
    ],
)
def test_bad_soak_options_are_one_line_config_errors(over, options, named):
    from toolkit.modes.soak import check_options

    with pytest.raises(ConfigError, match=named) as caught:
        check_options(options, over)
    assert "\n" not in str(caught.value)


@settings(max_examples=300)
@given(st.sampled_from(["engine", "http"]), st.data())
def test_fuzzed_soak_options_pass_only_in_range(over, data):
    from toolkit.modes.soak import ENGINE_CHECKS, HTTP_CHECKS, check_options

    table = ENGINE_CHECKS if over == "engine" else HTTP_CHECKS
    options = data.draw(st.dictionaries(st.sampled_from(sorted(table)), NUMBERS, max_size=4))
    try:
        check_options(dict(options), over)
    except ConfigError as exc:
        assert str(exc).startswith("soak.") and "\n" not in str(exc)
        return
    assert over == "http" or "duration_s" in options
    for name, value in options.items():  # what passed is of its kind and in its range
        kind, least, most = table[name]
        assert isinstance(value, bool) == (kind == "bool")
        assert kind == "bool" or (math.isfinite(value) and least <= value <= most)
        assert kind != "count" or isinstance(value, int)
