"""The systems a benchmark compares, each serving the same greedy requests on the same weights.

- engine: ours (with the trace writer, as `make run` runs it; or without it)
- hf_static: HF `generate` on left-padded static batches in arrival order
- hf_cb: HF continuous batching (`generate_batch` machinery, paged attention)
- naive: a no-cache loop (the whole sequence through HF's forward for every token)
- llama_cpp: llama-cpp-python on the original Q4_1 GGUF, when installed (other precision)
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from toolkit.bench.workloads import BenchRequest
from toolkit.config import EngineConfig, SpeculativeConfig, from_mapping
from toolkit.engine.core import Engine
from toolkit.native.child import run_in_child
from toolkit.runs.manifest import new_run_id
from toolkit.runs.metrics import InterTokenLatency, percentile
from toolkit.sampling.params import SamplingParams
from toolkit.trace.writer import TraceWriter


@dataclass
class SystemResult:
    name: str
    tokens: dict[str, list[int]]
    wall_s: float
    prompt_tokens: int
    ttft_s: dict[str, float] = field(default_factory=dict)
    tpot_s: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def add_times(self, request_id: str, start: float, token_times: list[float]) -> None:
        """TTFT (first token time - start) and TPOT (mean gap between later tokens) of one request."""
        if token_times:
            self.ttft_s[request_id] = token_times[0] - start
            if len(token_times) > 1:
                self.tpot_s[request_id] = (token_times[-1] - token_times[0]) / (len(token_times) - 1)

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    def summary(self) -> dict[str, Any]:
        ttft, tpot = list(self.ttft_s.values()), list(self.tpot_s.values())
        return {
            "requests": len(self.tokens),
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "output_tok_per_s": self.output_tokens / self.wall_s,
            "total_tok_per_s": (self.output_tokens + self.prompt_tokens) / self.wall_s,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p95_s": percentile(ttft, 95),
            "tpot_p50_s": percentile(tpot, 50),
            "tpot_p95_s": percentile(tpot, 95),
            "peak_rss_mb": self.peak_rss_mb,
            **self.extra,
        }


@contextmanager
def rss_monitor(interval_s: float = 0.05):
    """Sample this process's RSS while the block runs; yields a dict whose 'peak_mb' is filled at exit."""
    proc = psutil.Process()
    out = {"peak_mb": proc.memory_info().rss / 2**20}
    stop = threading.Event()

    def watch():
        while not stop.wait(interval_s):
            out["peak_mb"] = max(out["peak_mb"], proc.memory_info().rss / 2**20)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()
        out["peak_mb"] = max(out["peak_mb"], proc.memory_info().rss / 2**20)


# --------------------------------------------------------------------------- ours


def run_engine(
    loaded,
    engine_cfg: EngineConfig,
    requests: list[BenchRequest],
    trace_dir: Path | None = None,
    name: str = "engine",
    speculative: SpeculativeConfig | None = None,
    sampling: dict[str, Any] | None = None,
) -> SystemResult:
    """The requests through our engine: greedy, or with the `sampling` fields given (every request
    still makes its max_tokens, ignore_eos, so sampled and greedy runs do the same work)."""
    fields = {"temperature": 0.0, **(sampling or {})}
    engine = Engine(loaded, engine_cfg, SamplingParams(temperature=0.0), speculative)
    for r in requests:
        params = from_mapping(
            SamplingParams, {**fields, "max_tokens": r.max_tokens, "ignore_eos": True}, section="bench.sampled_variants"
        )
        engine.add_request(
            prompt_token_ids=r.prompt_token_ids, request_id=r.id, arrival_step=r.arrival_step, sampling_params=params
        )
    writer = TraceWriter(trace_dir, new_run_id()) if trace_dir is not None else None
    step_log = []
    itl = InterTokenLatency()
    with rss_monitor() as rss:
        while engine.has_unfinished():
            t = time.perf_counter()
            out = engine.step(trace_digests=writer is not None)
            itl.update(out.samples)
            if writer is not None:
                writer.write_output(out)
            if out.batch_size:
                step_log.append(
                    (
                        out.batch_size,
                        out.num_decode_tokens,
                        out.num_prefill_tokens,
                        time.perf_counter() - t,
                        out.forward_s,
                    )
                )
        end = engine.last_finish_time
        if writer is not None:
            writer.close()  # the trace is part of the job: generation ends when it is on disk
            end = time.perf_counter()
    wall = end - engine.first_admission_time
    result = SystemResult(name, {}, wall, sum(len(r.prompt_token_ids) for r in requests), peak_rss_mb=rss["peak_mb"])
    queues = []
    for r in requests:
        out = engine.output(r.id)
        result.tokens[r.id] = list(out.output_token_ids)
        m = out.metrics
        queues.append(m.queue_s)
        result.ttft_s[r.id] = m.ttft_s
        if m.tpot_s is not None:
            result.tpot_s[r.id] = m.tpot_s
    pool = engine.stats()
    result.extra = {
        "steps": engine.step_index,
        "traced": writer is not None,
        "itl_p50_s": percentile(itl.values, 50),
        "itl_p95_s": percentile(itl.values, 95),
        "itl_p99_s": percentile(itl.values, 99),
        "queue_p50_s": percentile(queues, 50),
        "queue_p95_s": percentile(queues, 95),
        "requests_per_s": len(requests) / wall if wall > 0 else None,
        "prompt_tok_per_s": sum(len(r.prompt_token_ids) for r in requests) / wall if wall > 0 else None,
        "scheduler_policy": engine_cfg.scheduler_policy,
        **(
            {"trace_engine_thread_s": writer.engine_thread_s, "trace_worker_cpu_s": writer.worker_cpu_s}
            if writer is not None
            else {}
        ),
        "attention_backend": engine.attention_backend,
        "preemptions": pool.preemptions,
        "prefix_cache_hit_rate": pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else None,
        **(engine.speculator.stats.summary() if engine.speculator is not None else {}),
    }
    result.extra.update(_host_work(step_log))
    return result


def _host_work(step_log: list[tuple[int, int, int, float, float]]) -> dict[str, Any]:
    """Of the decode-only steps (the steady state), the median step time and the median share of it
    spent outside the model's forward: scheduling, packing, processors, sampling, commit, trace."""
    decode = [(batch, step_s, forward_s) for batch, _, prefill, step_s, forward_s in step_log if prefill == 0]
    if not decode:
        return {}
    return {
        "decode_steps": len(decode),
        "decode_batch_p50": percentile([b for b, _, _ in decode], 50),
        "decode_step_p50_s": percentile([s for _, s, _ in decode], 50),
        "decode_host_fraction_p50": percentile([1 - f / s for _, s, f in decode], 50),
    }


# --------------------------------------------------------------------------- HF transformers


def load_hf_model(path: str | Path, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM  # deferred: transformers, seconds to import
    from transformers.utils import logging as hf_logging  # deferred: transformers, seconds to import

    hf_logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attn).eval()


class StepClock:
    """A logits processor that only records when each generation step happens."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_hf_static(model, requests: list[BenchRequest], batch_size: int, pad_id: int) -> SystemResult:
    from transformers import LogitsProcessorList  # deferred: transformers, seconds to import

    result = SystemResult("hf_static", {}, 0.0, sum(len(r.prompt_token_ids) for r in requests))
    with rss_monitor() as rss:
        start = time.perf_counter()
        for s in range(0, len(requests), batch_size):
            batch = requests[s : s + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.tensor([[pad_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
            mask = torch.tensor(
                [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch]
            )
            clock = StepClock()
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=pad_id,
                    max_new_tokens=max(r.max_tokens for r in batch),
                    logits_processor=LogitsProcessorList([clock]),
                )
            for row, r in enumerate(batch):
                result.tokens[r.id] = out[row, width : width + r.max_tokens].tolist()
                times = clock.times[: r.max_tokens]
                result.add_times(r.id, start, times)  # every request arrived at the start
        result.wall_s = time.perf_counter() - start
    result.peak_rss_mb = rss["peak_mb"]
    result.extra = {"batch_size": batch_size}
    return result


def run_hf_cb(model, requests: list[BenchRequest]) -> SystemResult:
    """HF continuous batching: every request added at the start with its own max_new_tokens."""
    from transformers import GenerationConfig  # deferred: transformers, seconds to import

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=256)
    result = SystemResult("hf_cb", {}, 0.0, sum(len(r.prompt_token_ids) for r in requests))
    with rss_monitor() as rss:
        with model.continuous_batching_context_manager(
            generation_config=gen, block=True, timeout=5, warmup=False
        ) as manager:
            start = time.perf_counter()
            for r in requests:
                manager.add_request(
                    r.prompt_token_ids, request_id=r.id, max_new_tokens=r.max_tokens, record_timestamps=True
                )
            done = 0
            while done < len(requests):
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("HF continuous batching stopped unexpectedly")
                    continue
                if out.is_finished():
                    done += 1
                    result.tokens[out.request_id] = list(out.generated_tokens)
                    result.add_times(out.request_id, start, out.timestamps or [])
            result.wall_s = time.perf_counter() - start
    result.peak_rss_mb = rss["peak_mb"]
    return result


def run_naive(model, requests: list[BenchRequest]) -> SystemResult:
    """The seeds' baseline: no KV cache, the full sequence through the model for every new token."""
    result = SystemResult("naive", {}, 0.0, sum(len(r.prompt_token_ids) for r in requests))
    with rss_monitor() as rss:
        start = time.perf_counter()
        for r in requests:
            ids = list(r.prompt_token_ids)
            times = []
            for _ in range(r.max_tokens):
                with torch.inference_mode():
                    logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
                times.append(time.perf_counter())
            result.tokens[r.id] = ids[len(r.prompt_token_ids) :]
            result.add_times(r.id, start, times)
        result.wall_s = time.perf_counter() - start
    result.peak_rss_mb = rss["peak_mb"]
    return result


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None  # not imported here: it runs in a child process


def run_llama_cpp(gguf_path: Path, requests: list[BenchRequest], threads: int) -> SystemResult:
    """llama.cpp through llama-cpp-python on the Q4_1 GGUF itself: a different precision, reported beside. It
    runs in a child process (its peak RSS is the child's); a crash there is a ForeignEngineError."""
    return run_in_child(_run_llama_cpp, gguf_path, requests, threads, what="llama.cpp", timeout=3600)


def _run_llama_cpp(gguf_path: Path, requests: list[BenchRequest], threads: int) -> SystemResult:
    from llama_cpp import Llama  # deferred: llama_cpp, the [llama] extra

    llm = Llama(model_path=str(gguf_path), n_ctx=4096, n_threads=threads, verbose=False, logits_all=False)
    result = SystemResult("llama_cpp", {}, 0.0, sum(len(r.prompt_token_ids) for r in requests))
    with rss_monitor() as rss:
        start = time.perf_counter()
        for r in requests:
            llm.reset()
            times, out = [], []
            for token in llm.generate(r.prompt_token_ids, top_k=1, temp=0.0, reset=True):
                out.append(int(token))
                times.append(time.perf_counter())
                if len(out) >= r.max_tokens:
                    break
            result.tokens[r.id] = out
            result.add_times(r.id, start, times)
        result.wall_s = time.perf_counter() - start
    result.peak_rss_mb = rss["peak_mb"]
    result.extra = {"precision": "Q4_1 (not comparable bit for bit)"}
    return result
