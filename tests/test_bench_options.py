"""The benchmark modes refuse a bad option up front: one ConfigError line naming the option, before a model
loads or anything is timed (the checks are called directly; a few CLI runs show the `error: ...` line and exit 2
of a mode and an entry point)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_cli import ROOT, run_cli
from toolkit.bench import kv_quantization, matmul_shapes, recompute
from toolkit.bench.formats import precision_options
from toolkit.bench.options import bench_options, entry_point
from toolkit.bench.scheduling import scheduling_options
from toolkit.bench.workloads import make_workload
from toolkit.config import EngineConfig, ModelConfig
from toolkit.engine.synthetic import decode_step_ms
from toolkit.errors import ConfigError
from toolkit.models import load_model

BENCH = {  # conf/bench/default.yaml, the options the checks read
    "workload": "standard",
    "num_requests": None,
    "max_tokens": None,
    "seed": 0,
    "systems": ["engine", "engine_notrace"],
    "repeats": 1,
    "roofline": True,
    "roofline_batches": [1, 8],
    "roofline_contexts": [32],
    "roofline_batch_context": 256,
    "roofline_context_batch": [32, 64],
    "sampled_variants": {"t0.8": {"temperature": 0.8, "top_p": 0.95, "seed": 0}},
    "host_work_batch": 64,
    "engine_variants": None,
    "invariant_batches": [1, 16],
    "text_tokens": 4096,
    "kv_dtypes": ["auto", "int8"],
    "kv_context": 2048,
}


def refused(fn, *names: str) -> str:
    """fn() raises one ConfigError line naming every one of `names`."""
    with pytest.raises(ConfigError) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text
    for name in names:
        assert name in text, text
    return text


def test_the_default_sections_pass():
    bench_options(BENCH, EngineConfig(), None)
    scheduling_options(
        {"sweep": {"max_num_seqs": [1, 2]}, "plot_x": "max_num_seqs", "plot_y": ["short.ttft_p95_s"]}, EngineConfig()
    )
    scheduling_options({"kind": "walkthrough"}, EngineConfig())
    assert kv_quantization.kv_quantization_options({"variants": ["int8", "auto"], "reference": "ours", "atol": 1e-4})[
        0
    ] == ("auto", "block")
    assert precision_options({"variants": ["bfloat16"], "hf_spread": False})[0] == ("float32", "auto", "block")


@pytest.mark.parametrize(
    "section, names",
    [
        ({"columns": ["bogus"]}, ["scheduling.columns", "bogus"]),  # B1
        ({"plot_y": ["bogus", "ttft_p95"]}, ["scheduling.plot_y", "bogus"]),  # B2
        ({"plot_y": ["ttft_p95_s"], "plot_x": "nosuch"}, ["scheduling.plot_x", "nosuch"]),  # B2
        ({"kind": "walktrough"}, ["scheduling.kind", "walktrough"]),  # B8
        ({"sweep": {"max_num_seqs": 4}}, ["scheduling.sweep.max_num_seqs"]),  # B4
        ({"sweep": {"max_num_seqs": "48"}}, ["scheduling.sweep.max_num_seqs"]),  # B4
        ({"sweep": {"max_num_seqs": [1, "48"]}}, ["max_num_seqs=48", "engine.max_num_seqs"]),
        ({"variants": {"a": 5}}, ["scheduling.variants.a"]),  # B5
        ({"num_requests": 0}, ["scheduling.num_requests"]),  # B6
        ({"num_requests": 2.5}, ["scheduling.num_requests"]),
        ({"max_tokens": "abc"}, ["scheduling.max_tokens"]),
        ({"max_tokens": 0}, ["scheduling.max_tokens"]),
        ({"kind": "walkthrough", "max_batch_size": "abc"}, ["scheduling.max_batch_size"]),  # B7
        ({"kind": "walkthrough", "max_batch_size": 0}, ["scheduling.max_batch_size"]),
        ({"kind": "walkthrough", "arrivals": [[0, "hi"]]}, ["scheduling.arrivals"]),
        ({"kind": "walkthrough", "arrivals": [5]}, ["scheduling.arrivals"]),
        ({"kind": "walkthrough", "arrivals": [["x", "hi", 2]]}, ["scheduling.arrivals"]),
        ({"kind": "walkthrough", "arrivals": [[1.7, "hi", 2]]}, ["scheduling.arrivals"]),
    ],
)
def test_scheduling_options_are_checked_before_any_variant_runs(section, names):
    section = {"variants": {"a": {}}, **section} if "sweep" not in section and "variants" not in section else section
    refused(lambda: scheduling_options(section, EngineConfig()), *names)


@pytest.mark.parametrize(
    "override, names",
    [
        ({"num_requests": 0}, ["bench.num_requests"]),  # D1
        ({"num_requests": -1}, ["bench.num_requests"]),
        ({"workload": "long_prompt", "num_requests": 1}, ["bench.num_requests", "long_prompt"]),
        ({"host_work_batch": -3}, ["bench.host_work_batch"]),
        ({"repeats": "abc"}, ["bench.repeats"]),  # D2
        ({"repeats": 2.5}, ["bench.repeats"]),
        ({"repeats": 0}, ["bench.repeats"]),
        ({"roofline_batches": [0]}, ["bench.roofline_batches"]),  # D3
        ({"roofline_batches": 4}, ["bench.roofline_batches"]),
        ({"roofline_batches": [1.5]}, ["bench.roofline_batches"]),
        ({"roofline_context_batch": "abc"}, ["bench.roofline_context_batch"]),
        ({"roofline_contexts": [0]}, ["bench.roofline_contexts"]),
        ({"roofline_batch_context": -5}, ["bench.roofline_batch_context"]),
        ({"invariant_batches": [0]}, ["bench.invariant_batches"]),  # D4
        ({"text_tokens": 0}, ["bench.text_tokens"]),  # D5
        ({"kv_context": 0}, ["bench.kv_context"]),
        ({"grammar_batches": [0]}, ["bench.grammar_batches"]),
        ({"kv_dtypes": ["int4"]}, ["bench.kv_dtypes", "int4"]),
        ({"engine_variants": {"x": 5}}, ["bench.engine_variants.x"]),  # D6
        ({"engine_variants": ["a"]}, ["bench.engine_variants"]),
        ({"sampled_variants": {"x": 5}}, ["bench.sampled_variants.x"]),
        ({"engine_variants": {"x": {"max_num_seq": 2}}}, ["bench.engine_variants.x", "max_num_seq"]),
        ({"engine_variants": {"x": {"speculative": {"method": "bogus"}}}}, ["bench.engine_variants.x", "bogus"]),
        (
            {"engine_variants": {"x": {"kv_cache_dtype": "int8", "batch_invariant": True}}},
            ["bench.engine_variants.x", "batch_invariant"],
        ),
        ({"sampled_variants": {"x": {"temprature": 1}}}, ["bench.sampled_variants.x", "temprature"]),
        ({"systems": ["engine", "hf_static"]}, ["HF systems need a checkpoint directory"]),  # D7
        ({"systems": "engine"}, ["bench.systems"]),  # D8
        ({"seed": "abc"}, ["bench.seed"]),
        ({"kv_cost": "yes"}, ["bench.kv_cost"]),
    ],
)
def test_bench_options_are_checked_before_the_model_loads(override, names):
    refused(lambda: bench_options({**BENCH, **override}, EngineConfig(), None), *names)


@pytest.mark.parametrize(
    "study, names",
    [
        ({"variants": []}, ["kv_quantization.variants"]),  # C1
        ({"variants": "int8"}, ["kv_quantization.variants", "'int8'"]),  # C2
        ({"variants": ["auto"], "atol": "abc"}, ["kv_quantization.atol"]),  # C3
        ({"variants": ["auto"], "atol": True}, ["kv_quantization.atol"]),
        ({"variants": ["auto"], "atol": 0}, ["kv_quantization.atol"]),
        ({"variants": ["auto"], "reference": "bogus"}, ["kv_quantization.reference"]),
        ({"variants": ["int8", "int8"]}, ["kv_quantization.variants", "twice"]),  # C4
        ({"variants": ["int8/block", "int8"]}, ["kv_quantization.variants", "twice"]),
    ],
)
def test_kv_quantization_options_are_checked_before_any_variant_runs(study, names):
    refused(lambda: kv_quantization.kv_quantization_options({"reference": "ours", "atol": 1e-4, **study}), *names)


@pytest.mark.parametrize(
    "study, names",
    [
        ({"variants": []}, ["precision.variants"]),  # C1
        ({"variants": "bfloat16"}, ["precision.variants", "'bfloat16'"]),  # C2
        ({"variants": ["bfloat16/int4"]}, ["precision.variants", "bfloat16/int4"]),  # C5
        ({"variants": ["bfloat16", "bfloat16/auto"]}, ["precision.variants", "twice"]),
        ({"variants": ["bfloat16"], "hf_spread": "maybe"}, ["precision.hf_spread"]),  # C6
    ],
)
def test_precision_options_are_checked_before_a_model_loads(study, names):
    text = refused(lambda: precision_options(study), *names)
    assert "kv_quantization" not in text


@pytest.mark.parametrize(
    "args, names",
    [((0, None), ["num_requests"]), ((-3, None), ["num_requests"]), (("abc", None), ["num_requests"])]
    + [((2.5, None), ["num_requests"]), ((None, "abc"), ["max_tokens"]), ((None, 1.5), ["max_tokens"])]
    + [((None, 0), ["max_tokens"])],
)
def test_make_workload_names_the_callers_option(args, names):  # B6, D1
    refused(lambda: make_workload("standard", None, *args, section="scheduling"), *[f"scheduling.{n}" for n in names])


def test_a_decode_step_of_batch_zero_is_refused():  # D4
    loaded = load_model(ModelConfig(name="tiny"))
    refused(lambda: decode_step_ms(loaded, EngineConfig(), 0, 32), "batch")
    refused(lambda: decode_step_ms(loaded, EngineConfig(), 1, 0), "context")


@pytest.mark.parametrize(
    "main, argv, option",
    [
        (recompute.main, ["--model", "tiny", "--rounds", "0"], "--rounds"),  # E1
        (recompute.main, ["--model", "tiny", "--prompts", "0"], "--prompts"),
        (matmul_shapes.main, ["--rounds", "0", "--dtypes", "float32"], "--rounds"),  # E2
    ],
)
def test_entry_point_counts_are_refused_by_argparse(main, argv, option, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert option in capsys.readouterr().err


def test_an_entry_point_prints_a_toolkit_error_as_one_line(capsys):
    def main(argv):
        raise ConfigError("engine.device: no such device")

    assert entry_point(main, []) == 2
    assert capsys.readouterr().err == "error: engine.device: no such device\n"


@pytest.mark.parametrize(
    "module, argv, option",
    [
        ("precision", ["--shape", "--formats", "float32", "--batches", "0"], "--batches"),
        ("precision", ["--shape", "--device", "bogus"], "--device"),
        ("host_step", ["--steps", "0"], "--steps"),
        ("gpu", ["--device", "cpu", "--shape", "tiny", "--batches", "-2"], "--batches"),
        # a schedule the engine does not know was a traceback after llama-server had started
        ("one_stream", ["--matmul-schedules", "auto", "hexes-nope"], "--matmul-schedules"),
        ("one_stream", ["--rounds", "0"], "--rounds"),
        ("one_stream", ["--batched", "-1"], "--batched"),
        ("one_stream", ["--dtypes", "fp8"], "--dtypes"),
    ],
)
def test_the_bench_entry_points_refuse_a_bad_option_in_one_line(module, argv, option):
    proc = subprocess.run(
        [sys.executable, "-m", f"toolkit.bench.{module}", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and option in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize(
    "args, option",
    [
        (["mode=scheduling", "scheduling.kind=walktrough"], "scheduling.kind"),
        (["mode=scheduling", "+scheduling.variants.a={}", "scheduling.plot_y=[bogus]"], "scheduling.plot_y"),
        (["mode=bench", "bench.repeats=0"], "bench.repeats"),
        (["mode=kv_quantization", "kv_quantization.variants=[]"], "kv_quantization.variants"),
    ],
)
def test_the_modes_refuse_a_bad_option_before_the_model_loads(args, option, tmp_path):
    proc = run_cli(*args, "model=tiny", run_dir=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], proc.stderr[-2000:]


def test_a_categorical_sweep_is_plotted_on_a_categorical_axis(tmp_path, monkeypatch):  # B3
    from toolkit.bench import scheduling
    from toolkit.runs.plots import _pyplot

    plt = _pyplot()
    monkeypatch.setattr(plt, "close", lambda fig: None)  # keep the figure to look at
    rows = {
        f"scheduler_policy={p}": {"overrides": {"scheduler_policy": p}, "output_tok_per_s": v}
        for p, v in (("fused", 3.0), ("two_forwards", 2.0))
    }
    report = {"variants": rows, "workload": {"name": "standard"}}
    scheduling.plot(report, {"plot_x": "scheduler_policy", "plot_y": ["output_tok_per_s"]}, tmp_path / "s.png")
    ax = plt.gcf().axes[0]
    assert ax.get_xscale() == "linear"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fused", "two_forwards"]
    assert list(ax.lines[0].get_ydata()) == [3.0, 2.0]
    plt.close("all")
