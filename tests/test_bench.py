"""The benchmark harness runs end to end on the tiny model and reports what it promises (figures
are not asserted: speed is measured by `make bench`, never by tests)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest
import torch

from tests.conftest import NATIVE_OFF, native_only
from tests.test_cli import run_cli
from toolkit.bench import gpu_shapes, matmul_shapes
from toolkit.native import gpu_matmul as gm
from toolkit.native import invariant_gpu as ig
from toolkit.native import ops, schedules


@pytest.mark.native
def test_bench_harness_reports_systems_roofline_kernels_and_kv_capacity(tmp_path):
    proc = run_cli(
        "mode=bench",
        "model=tiny",
        "bench.systems=[engine,engine_notrace]",
        "bench.num_requests=4",
        "bench.max_tokens=8",
        "bench.roofline_batches=[1,4]",
        "bench.roofline_contexts=[32]",
        "bench.roofline_batch_context=32",
        "bench.roofline_context_batch=[1,2]",
        "bench.kv_cost=true",
        "bench.kv_dtypes=[auto,int8]",
        "bench.kv_context=64",
        "bench.kv_budget_gb=0.0002",
        "bench.engine_variants={torch_matmul: {matmul_backend: torch}}",
        "bench.kernel_cost=true",
        "bench.host_work_batch=4",
        "bench.text_cost=true",
        "bench.text_tokens=400",
        run_dir=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    sampled = {"engine[t0.8_top_p0.95]", "engine[t0.8_top_k50_rep1.1]"}  # conf/bench/default.yaml
    assert set(report["systems"]) == {"engine", "engine_notrace", "engine[torch_matmul]"} | sampled
    for name in sampled:  # sampled beside greedy: the same work (ignore_eos), traced, its ratio and host share
        assert report["systems"][name]["output_tokens"] == report["systems"]["engine"]["output_tokens"]
        assert report["systems"][name]["sampling"]["temperature"] == 0.8
        assert report["sampled_over_greedy"][name] > 0
        assert 0 < report["systems"][name]["decode_host_fraction_p50"] < 1
    host = report["host_work_at_batch"]
    assert set(host) == {"greedy", "t0.8_top_p0.95", "t0.8_top_k50_rep1.1"}
    assert all(h["decode_batch_p50"] == 4 and 0 < h["decode_host_fraction_p50"] < 1 for h in host.values())
    assert report["greedy_agreement"]["engine_notrace"]["identical"] == 4  # tracing changes no token
    assert report["systems"]["engine"]["output_tokens"] == report["systems"]["engine_notrace"]["output_tokens"]
    work = report["trace_work"]  # the trace's own time, measured where it runs
    assert work["engine_thread_s"] > 0 and work["worker_cpu_s"] > 0 and 0 < work["fraction_of_wall"] < 1
    roof = report["roofline"]
    native_sizes = set() if NATIVE_OFF else {"1", "2", "4"}  # TOOLKIT_NATIVE=0: torch's GEMM alone
    assert set(roof["gemm_gflops_torch"]) == {"1", "2", "4"} and set(roof["gemm_gflops_native"]) == native_sizes
    assert [(r["batch"], r["context"]) for r in roof["by_context"]] == [(1, 32), (2, 32)]
    for row in roof["by_batch"] + roof["by_context"]:
        assert row["step_ms"] > 0 and row["gemm_bound_ms"] > 0 and row["gemm_gflops_alongside"] > 0
        assert abs(row["fraction_of_gemm_roofline"] - row["gemm_bound_ms"] / row["step_ms"]) < 1e-9
    text = report["text_cost"]  # fed a token at a time, the incremental text is the whole output's decode
    assert text["tokens"] == 400 and text["window"] == 100 and text["same_text"] is True
    assert all(r["start_us"] > 0 and r["end_us"] > 0 for r in text["runs"])
    kv = {(r["kv_cache_dtype"], r["attention_backend"]): r for r in report["kv_cost"]}
    assert kv[("int8", "auto")]["kv_bytes_per_sequence"] < kv[("auto", "auto")]["kv_bytes_per_sequence"] / 3.5
    assert kv[("int8", "auto")]["max_batch"] >= 3 * kv[("auto", "auto")]["max_batch"]
    kernels = report["kernel_cost"]
    if NATIVE_OFF:  # nothing native to measure: recorded as such, and the rest of the report is whole
        assert kernels == {"unavailable": "native kernels are switched off (TOOLKIT_NATIVE=0; unset it to use them)"}
        assert (tmp_path / "bench.png").is_file()
        return
    assert len(kernels["attention_decode"]) == 2 and len(kernels["attention_prefill"]) == 1
    for row in kernels["attention_decode"] + kernels["attention_prefill"]:
        assert row["max_abs_diff"] < 1e-5 and row["kernel_ms"] > 0  # the two paths compute the same attention
    assert kernels["rope"] and all(r["bit_identical"] for r in kernels["rope"])
    assert (tmp_path / "bench.png").is_file()


@native_only
def test_the_matmul_shapes_benchmark_times_every_schedule_of_every_weight(tmp_path, capsys):
    """python -m toolkit.bench.matmul_shapes on the tiny shape: every projection and the LM head, every class of rows
    and every schedule timed over a pass past 96 MB, the fastest marked once a row, the machine's stream measured
    before and after, and the JSON the figures returned."""
    out = tmp_path / "shapes.json"
    result = matmul_shapes.main(["--shape", "tiny", "--dtypes", "float32", "--rounds", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    figures = result["float32"]
    assert set(figures) == {"w_qkv", "w_o", "w_gate_up", "w_down", "lm_head"}
    assert figures["lm_head"]["shape"] == [256, 512] and figures["w_down"]["shape"] == [512, 256]
    for f in figures.values():
        assert f["mb_a_pass"] >= matmul_shapes.PASS_BYTES / 1e6
        assert [rows for rows in f["classes"]] == [f"{a}-{b}" for a, b, _ in schedules.ROW_CLASSES]
        for by in f["classes"].values():
            assert list(by) == list(schedules.SCHEDULES) and all(v["us"] > 0 and v["gbs"] > 0 for v in by.values())
    assert len(result["stream_gbs"]) == 2 and all(g > 0 for g in result["stream_gbs"])
    assert json.loads(out.read_text())["float32"] == json.loads(json.dumps(figures))
    assert printed.count(")*") == sum(len(f["classes"]) for f in figures.values())  # one fastest a row


@native_only
def test_the_copies_past_the_caches_are_the_weights_in_memory_of_their_own():
    """Each copy holds its weight's bits (the same product, bit for bit) in memory no other weight shares, on a
    64-byte line, and the pass reaches the bytes asked for."""
    gen = torch.Generator().manual_seed(0)
    weights = [ops.pack_weight(torch.randn(64, 96 + 16 * i, generator=gen)) for i in range(3)]
    copies = matmul_shapes.past_caches(weights, min_bytes=1 << 20)
    assert all(a is b for a, b in zip(copies, weights)) and sum(w.data.numel() * 4 for w in copies) >= 1 << 20
    x = torch.randn(2, 64, generator=gen)
    for i, copy in enumerate(copies):
        assert torch.equal(ops.matmul_invariant(x, copy), ops.matmul_invariant(x, weights[i % 3]))
    spans = sorted((w.data.data_ptr(), w.data.data_ptr() + w.data.numel() * 4) for w in copies)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "two weights share memory"
    assert all(w.data.data_ptr() % 64 == 0 for w in copies[3:])


@pytest.mark.native
def test_the_gpu_benchmark_runs_on_the_cpu_and_prints_each_figure(tmp_path, capsys):
    """python -m toolkit.bench.gpu, as CI can run it (the CPU, the small shape): every bucket timed, its
    kernels counted, its floor the step's weight bytes at the measured bandwidth, HF's decode step, the
    batch-invariant mode and async scheduling beside it, the goals it measures named; the figures written as JSON
    too."""
    from toolkit.bench import gpu

    out = tmp_path / "gpu.json"
    result = gpu.main(
        [
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--batches",
            "1",
            "3",
            "--steps",
            "2",
            "--hf-tokens",
            "3",
            "--batch-invariant",
            "--async-scheduling",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    shape = gpu_shapes.SHAPES["tiny"]
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"]
    head = hidden // shape["num_heads"]
    qkv = hidden * (hidden + 2 * shape["num_kv_heads"] * head)
    per_layer = qkv + hidden * hidden + 2 * hidden * inter + inter * hidden + 2 * hidden
    params = layers * per_layer + hidden + hidden * shape["vocab_size"]  # the final norm and the LM head
    assert [(r["dtype"], r["batch"]) for r in result["rows"]] == [
        (d, b) for d in ("float32", "bfloat16") for b in (1, 3)
    ]
    for row in result["rows"]:
        size = 4 if row["dtype"] == "float32" else 2
        assert row["floor_ms"] == pytest.approx(1000 * params * size / (result["copy_bandwidth_gbs"] * 1e9))
        assert row["ms"] > 0 and row["tok_s"] == pytest.approx(1000 * row["batch"] / row["ms"])
        assert row["kernels"] >= 1 and row["busy"] is None  # the CPU: torch ops counted, no GPU busy share
        assert row["hf_ms"] > 0
        if NATIVE_OFF:  # the invariant mode needs the native kernels: refused, and the row says why
            assert row["invariant"]["refused"].startswith("engine.batch_invariant=true is unavailable here")
        else:
            assert row["invariant"]["ms"] > 0
        assert row["async"]["ms"] > 0 and row["async"]["default_ms"] > 0 and row["async"]["busy"] is None
        # the CPU's steps wait on no CUDA event and its drain is next to nothing: the host's work is about the step
        a = row["async"]
        assert 0.9 * a["ms"] < a["host_ms"] <= a["ms"]
        assert 0.9 * a["default_ms"] < a["default_host_ms"] <= a["default_ms"]
    assert printed.count(" ms a step,") == 4 and printed.count("async scheduling") == 4 and printed.count("(host ") == 8
    assert f"on {gpu.machine('cpu')}; copy bandwidth" in printed.splitlines()[0]  # the device named
    assert any(line.startswith("goal ") and "fp32's" in line for line in result["goals"])


@pytest.mark.native
@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_the_gpu_benchmark_gives_a_config_jsons_shape_random_weights_that_hf_runs_too(tmp_path, capsys, family):
    """--shape a config.json (or its directory): HF transformers' own random init of that architecture, timed in
    the engine and in HF's generate on the same weights (the engine's logits are HF's within fp32 rounding), the
    run named by the file; the kernel table's products are the architecture's own (Qwen3's heads wider than
    hidden / heads, GPT-2's ungated MLP). A config the engine cannot run, or no config at all, is one line."""
    from tests.families import CONFIGS
    from toolkit.bench import gpu
    from toolkit.bench.gpu_kernels import decode_products
    from toolkit.engine.runner import recompute_logits
    from toolkit.models.families import arch_from_hf_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIGS[family]))
    argv = ["--device", "cpu", "--shape", str(tmp_path), "--dtypes", "float32", "--batches", "2", "--steps", "2"]
    result = gpu.main(argv + ["--hf-tokens", "3", "--json", str(tmp_path / "out.json")])
    assert result["shape"] == json.loads((tmp_path / "out.json").read_text())["shape"] == str(config)
    assert f"random weights of {config}'s shape" in capsys.readouterr().out.splitlines()[0]
    assert [(r["batch"], r["ms"] > 0, r["hf_ms"] > 0) for r in result["rows"]] == [(2, True, True)]
    loaded, hf = gpu_shapes.shape_model(config, "float32", torch.device("cpu"), hf=True)
    assert loaded.arch.family == family and loaded.model_id.startswith(f"random {family} weights of {config}")
    tokens = [(7 * j + 3) % loaded.arch.vocab_size for j in range(12)]
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0].float()
    assert (recompute_logits(loaded.model, tokens) - theirs).abs().max() < 1e-4
    spec = CONFIGS[family]
    hidden, heads = spec.get("hidden_size", spec.get("n_embd")), spec.get("num_attention_heads", spec.get("n_head"))
    width = spec.get("intermediate_size", 4 * hidden)
    head_dim = spec.get("head_dim", hidden // heads)
    kv = spec.get("num_key_value_heads", heads) * head_dim
    mlp = 2 * width if family != "gpt2" else width
    want = ((hidden, heads * head_dim + 2 * kv), (heads * head_dim, hidden), (hidden, mlp), (width, hidden))
    assert decode_products(asdict(loaded.arch)) == want + ((hidden, spec["vocab_size"]),)
    qwen3 = arch_from_hf_config(gpu_shapes.CONFIG_SHAPES["qwen3-0.6b"])  # Qwen3-0.6B's, as its config.json says
    assert gpu_shapes.shape_source("qwen3-0.6b") == "qwen3-0.6b" and (qwen3.family, qwen3.qk_norm) == ("qwen3", True)
    assert decode_products(asdict(qwen3)) == ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936))
    (tmp_path / "odd.json").write_text(json.dumps({**spec, "model_type": "mamba"}))
    for shape, says in ((tmp_path / "odd.json", "unsupported model_type 'mamba'"), (tmp_path / "no", "neither")):
        with pytest.raises(SystemExit) as exc:
            gpu.main(["--device", "cpu", "--shape", str(shape)])
        assert exc.value.code == 2 and says in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_gpu_benchmarks_wait_clock_counts_the_waits_and_puts_synchronize_back(monkeypatch):
    """WaitClock (the GPU benchmark's host share with async scheduling): the seconds in CUDA events' synchronize
    while entered, none after, and the method as it was once left (a clock that missed the waits would call the
    host's share the whole step; one that left its wrapper would time every later wait)."""
    import time

    import torch

    from toolkit.bench import clocks

    def slow(event):
        time.sleep(0.01)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", slow)
    with clocks.WaitClock() as waits:
        for _ in range(3):
            torch.cuda.Event.synchronize(None)
    torch.cuda.Event.synchronize(None)
    assert 0.03 <= waits.seconds < 1 and torch.cuda.Event.synchronize is slow


@pytest.mark.native
def test_the_host_step_benchmark_takes_the_forward_out(capsys):
    """python -m toolkit.bench.host_step: every batch size with async scheduling off and on, the machine named; the
    forward's seconds are not in the figure (a forward made 20 ms slower leaves it under 20 ms a step; a clock that
    counted nothing, or the whole step, would not)."""
    import time

    from toolkit.bench import clocks, host_step
    from toolkit.config import ModelConfig
    from toolkit.models import load_model

    result = host_step.main(["--batches", "1", "4", "--steps", "3", "--repeats", "1"])
    assert list(result) == ["batch 1", "batch 1 async", "batch 4", "batch 4 async"]
    assert all(0 < ms < 1000 for ms in result.values())
    assert "host ms a decode step outside the forward" in capsys.readouterr().out
    loaded = load_model(ModelConfig(**host_step.SHAPE), device="cpu")
    clock = clocks.ForwardClock(loaded.model)
    slow = clock.inner

    def slower(*args, **kwargs):
        time.sleep(0.02)
        return slow(*args, **kwargs)

    clock.inner = slower
    figures = host_step.host_ms(loaded, clock, 2, False, 3, 1)
    assert clock.seconds >= 3 * 0.02 and 0 < figures[0] < 20


@pytest.mark.native
def test_the_long_prefill_benchmark_takes_the_steps_the_chunk_cost_gives(capsys):
    """python -m toolkit.bench.long_prefill: each engine.dynamic_chunking setting's steps to the long prompt's first
    token are its chunks, as fitting_chunk sizes them (16 a step when off), the machine named."""
    from toolkit.bench import long_prefill
    from toolkit.bench.precision import machine
    from toolkit.engine.scheduler import fitting_chunk

    args = ["--model", "tiny", "--prompt", "300", "--streams", "2", "--budget", "32", "--chunk", "16"]
    result = long_prefill.main([*args, "--modes", "off", "16", "auto", "--repeats", "2"])

    def chunks(scale: int | None) -> int:
        done = count = 0
        while done < 300:
            done, count = done + min(300 - done, fitting_chunk(16, done, scale)), count + 1
        return count

    assert [r["steps"] for r in result["off"]] == [chunks(None)] * 2 == [19] * 2
    assert [r["steps"] for r in result["16"]] == [chunks(16)] * 2
    assert [r["steps"] for r in result["auto"]] == [chunks(288)] * 2  # the tiny model's shape (test_dynamic_chunking)
    assert all(0 < r["step_p50_s"] <= r["step_max_s"] <= r["ttft_s"] for runs in result.values() for r in runs)
    out = capsys.readouterr().out
    assert "2 streams decoding, then a prompt of 300 ids" in out and machine("cpu") in out
    with pytest.raises(SystemExit):
        long_prefill.main([*args, "--modes", "sometimes"])
    assert "--modes: must be off, auto or a positive integer, got 'sometimes'" in capsys.readouterr().err


@pytest.mark.native
def test_the_host_step_benchmarks_device_route_runs_a_gpus_host_code_and_is_put_back(monkeypatch):
    """--route device times the host code a GPU's steps run (the sampler's work queued and read once, DeviceSample),
    on the CPU; afterwards the CPU's route is back (devices.off_cpu, TOOLKIT_NATIVE as they were). A route that
    only named itself would queue no DeviceSample; one left widened would send the next engine down it."""
    from toolkit import devices
    from toolkit.bench import host_step
    from toolkit.sampling import sampler

    monkeypatch.setenv("TOOLKIT_NATIVE", "1")
    queued = []
    init = sampler.DeviceSample.__init__
    monkeypatch.setattr(sampler.DeviceSample, "__init__", lambda self, *a: queued.append(1) or init(self, *a))
    result = host_step.main(["--batches", "2", "--steps", "3", "--repeats", "1", "--route", "device"])
    assert list(result) == ["batch 2", "batch 2 async"] and all(0 < ms < 1000 for ms in result.values())
    assert len(queued) >= 2 * 3
    assert not devices.off_cpu(torch.empty(0)) and os.environ["TOOLKIT_NATIVE"] == "1"
    queued.clear()
    host_step.main(["--batches", "2", "--steps", "3", "--repeats", "1"])
    assert not queued


@pytest.mark.parametrize(
    "text, blocks",
    [("64,16,256", (64, 16, 256)), ("64,16,256,4", (64, 16, 256, 4)), ("16,16,16,1", (16, 16, 16, 1))]
    + [(bad, None) for bad in ("64,16", "64,16,256,9", "64,16,256,0", "8,16,16", "64,24,64", "a,b,c", "64,16,256,4,1")],
)
def test_the_gpu_benchmarks_tiling_is_three_powers_of_two_then_its_stages(text, blocks):
    """--dot-blocks / --dot-blocks-fp32: BM,BN,BK (powers of two, at least 16: what tl.dot takes), then optionally
    the pipeline's stages (1 to 8); anything else is refused before a GPU compiles it."""
    import argparse

    from toolkit.bench import gpu_kernels

    if blocks is None:
        with pytest.raises(argparse.ArgumentTypeError, match="a tiling is BM,BN,BK"):
            gpu_kernels.tiling(text)
    else:
        assert gpu_kernels.tiling(text) == blocks


@pytest.mark.native
def test_the_gpu_benchmark_stores_the_weights_n_by_k_when_asked(monkeypatch, capsys):
    """--weights-nk: every engine the run makes reads its projections over (N, K) storage (gpu_matmul.
    store_weights_nk, called once a format, before the engines), and the run says so in its first line."""
    from toolkit.bench import gpu

    stored = []
    monkeypatch.setattr(
        gm, "store_weights_nk", lambda model, real=gm.store_weights_nk: stored.append(model) or real(model)
    )
    argv = ["--device", "cpu", "--shape", "tiny", "--batches", "2", "--steps", "2", "--hf-tokens", "0"]
    result = gpu.main(argv + ["--dtypes", "float32", "bfloat16", "--weights-nk"])
    assert result["weights"] == "(N, K)" and "the weights stored (N, K)" in capsys.readouterr().out.splitlines()[0]
    assert [m.embed.dtype for m in stored] == [torch.float32, torch.bfloat16]
    for model in stored:
        assert all(w.stride() == (1, w.shape[0]) for layer in model.layers for w in layer.parameters() if w.dim() == 2)
        assert model.lm_head_t.stride() == (1, model.lm_head_t.shape[0])
    assert all(row["ms"] > 0 for row in result["rows"])
    assert gpu.main(argv)["weights"] == "(K, N)" and len(stored) == 2


def test_the_kernel_table_names_the_tilings_whose_bits_are_not_the_own_tilings():
    """`--kernels` prints, after each product's figures, which tl.dot tilings do not give the format's own tiling's
    bits: a last bit apart is apart."""
    from toolkit.bench.gpu_kernels import same_bits

    own = torch.tensor([1.0, 2.0, 3.0])
    apart = torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item(), 3.0])
    outputs = {"tl.dot 64x16x64*": own, "tl.dot 16x16x64": own.clone(), "tl.dot 64x64x64": apart}
    assert same_bits(outputs) == "2 of 3 tilings' are tl.dot 64x16x64*'s; not: tl.dot 64x64x64"
    assert same_bits({"tl.dot 64x16x64*": own, "tl.dot 64x16x64 (N,K)": own.clone()}) == (
        "every tiling's are tl.dot 64x16x64*'s"
    )
    assert same_bits({"tl.dot 16x16x64": own}) == "the own tiling did not run"


@pytest.mark.skipif(
    not ig.available(torch.empty(0)),
    reason="Triton does not import here, or runs neither a GPU nor its interpreter (TRITON_INTERPRET=1)",
)
def test_the_kernel_table_times_every_tiling_of_every_product_and_says_whose_bits_differ(monkeypatch):
    """The kernel table on the CPU (Triton's interpreter, a small shape, the timer stubbed to one call): every
    decode product's line names torch, tl.sum and every tiling in both weight orders, then its bits line; the own
    tiling over weights stored (N, K) keeps the own tiling's bits."""
    from toolkit.bench import gpu_kernels

    calls = []
    monkeypatch.setattr(gpu_kernels, "kernel_ms", lambda fn, device: calls.append(fn()) or 1.0)
    dims = dict(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=16, vocab_size=48)
    lines, records = gpu_kernels.kernel_times(dims, ["bfloat16"], [2], torch.device("cpu"))
    figures = [line for line in lines if line.startswith("matmul ")]
    bits = [line for line in lines if line.startswith("  bits: ")]
    assert [line.split(":")[0] for line in figures] == [
        f"matmul bfloat16 2x{k} @ {k}x{n}" for k, n in ((32, 64), (32, 32), (32, 32), (16, 32), (32, 48))
    ]
    names = ["torch", "tl.sum"] + [f"tl.dot {'x'.join(map(str, b))}" for b in gm.candidate_tilings(torch.bfloat16)]
    names += ["torch (N,K)"] + [f"tl.dot {'x'.join(map(str, b))} (N,K)" for b in gm.layout_tilings(torch.bfloat16)]
    for line in figures:
        assert all(f"{name} 1.000 ms" in line or f"{name}* 1.000 ms" in line for name in names), line
    assert len(bits) == len(figures) and len(calls) == len(figures) * len(names) == len(records)
    assert all(r["ms"] == 1.0 and r["dtype"] == "bfloat16" and r["m"] == 2 for r in records)
    for r in records:  # each record names its tiling and the weights' order as its figure does
        assert r["name"].removesuffix("*").removesuffix(" (N,K)") == (
            f"tl.dot {'x'.join(map(str, r['blocks']))}" if r["blocks"] else r["name"].removesuffix(" (N,K)")
        )
        assert r["order"] == ("(N,K)" if r["name"].endswith("(N,K)") else "(K,N)")
    own_nk = f"tl.dot {'x'.join(map(str, gm.dot_blocks(torch.bfloat16)))} (N,K)"
    assert all(own_nk not in line and "did not run" not in line for line in bits), bits


def test_each_products_tiling_is_the_one_whose_worst_batch_is_fastest():
    """--dot-blocks-from: a product's tiling is the one whose worst ratio to torch's time over the batches is least
    (not the best at one batch), the format's own on a tie; a tiling that failed somewhere is never chosen; other
    formats' figures and the other weight order count for nothing; a product whose best is the own tiling is not
    named."""
    from toolkit.bench.gpu_kernels import KN, NK, fastest_tilings

    own, a, b = gm.dot_blocks(torch.bfloat16), (16, 16, 256), (64, 16, 256, 4)

    def fig(k, n, m, blocks, ms, order=KN, dtype="bfloat16", name=None):
        return dict(dtype=dtype, m=m, k=k, n=n, name=name or f"tl.dot {blocks}", blocks=blocks, order=order, ms=ms)

    figures = [fig(k, n, m, None, 1.0, name="torch") for k, n in ((8, 4), (8, 2), (4, 8)) for m in (1, 32)]
    figures += [fig(8, 4, 1, own, 2.0), fig(8, 4, 32, own, 1.2), fig(8, 4, 1, a, 1.1), fig(8, 4, 32, a, 1.5)]
    figures += [fig(8, 4, 1, b, 1.0), fig(8, 4, 32, b, 1.6)]  # b is the fastest at one row, a at its worst
    figures += [fig(8, 2, m, own, 1.3) for m in (1, 32)] + [fig(8, 2, m, a, 1.3) for m in (1, 32)]  # a tie
    figures += [fig(4, 8, m, own, 1.3) for m in (1, 32)] + [fig(4, 8, 1, b, 1.0), fig(4, 8, 32, b, float("nan"))]
    figures += [fig(4, 8, m, None, 0.5, order=NK, name="torch (N,K)") for m in (1, 32)]
    figures += [fig(4, 8, 1, a, 0.5, order=NK), fig(4, 8, 32, a, 0.4, order=NK)]
    figures += [fig(4, 8, 1, own, 0.6, order=NK), fig(4, 8, 32, own, 0.4, order=NK)]  # 1.2x at one row: a's 1.0x
    figures += [fig(4, 8, m, a, 0.5, dtype="float32") for m in (1, 32)]
    assert fastest_tilings(figures, "bfloat16") == {(8, 4): a}
    assert fastest_tilings(figures, "bfloat16", NK) == {(4, 8): a}
    assert fastest_tilings(figures, "float16") == {}


@pytest.mark.native
def test_the_gpu_benchmark_takes_each_products_tiling_from_a_kernel_tables_json(tmp_path, monkeypatch, capsys):
    """`--kernels --json F` keeps each figure as a record; `--dot-blocks-from F` gives each product the fastest
    tiling there (gpu_matmul.DOT_BLOCKS_BY_SHAPE, fp32's apart) and names the tilings in the run's first line, as a
    GPU run's manifest names them."""
    from toolkit.bench import gpu
    from toolkit.bench.gpu_kernels import KN

    monkeypatch.setattr(gm, "DOT_BLOCKS_BY_SHAPE", {})
    monkeypatch.setattr(gm, "DOT_BLOCKS_BY_SHAPE_FP32", {})
    fast, own = (16, 16, 256), gm.dot_blocks(torch.bfloat16)
    figures = [
        dict(dtype="bfloat16", m=m, k=256, n=256, name=name, blocks=blocks, order=KN, ms=ms)
        for m in (1, 32)
        for name, blocks, ms in (("torch", None, 1.0), ("own", own, 1.5), ("fast", fast, 1.1))
    ]
    monkeypatch.setattr(gpu, "kernel_times", lambda *args: (["a line"], figures))
    table = tmp_path / "kernels.json"
    gpu.main(["--device", "cpu", "--shape", "tiny", "--kernels", "--json", str(table)])
    assert json.loads(table.read_text())["kernel_figures"] == json.loads(json.dumps(figures))
    capsys.readouterr()
    argv = ["--device", "cpu", "--shape", "tiny", "--dtypes", "bfloat16", "--batches", "1", "--steps", "2"]
    result = gpu.main(argv + ["--hf-tokens", "0", "--dot-blocks-from", str(table)])
    assert gm.DOT_BLOCKS_BY_SHAPE == {(256, 256): fast} and gm.DOT_BLOCKS_BY_SHAPE_FP32 == {}
    assert gm.dot_blocks(torch.bfloat16, 256, 256) == fast and gm.dot_blocks(torch.bfloat16, 256, 512) == own
    assert gm.dot_blocks(torch.float32, 256, 256) == gm.DOT_BLOCKS_FP32
    first = capsys.readouterr().out.splitlines()[0]
    assert f"tilings {'x'.join(map(str, own))}; 256x256: 16x16x256 (16-bit)" in first, first
    assert result["rows"][0]["ms"] > 0
    with pytest.raises(SystemExit):  # argparse's one line: no file to read
        gpu.main(argv + ["--dot-blocks-from", str(tmp_path / "none.json")])
    assert "--dot-blocks-from: no file" in capsys.readouterr().err
