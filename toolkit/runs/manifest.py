"""Traces: the versioned schema, the streaming writer and the reader."""

from __future__ import annotations

import json
import platform
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from toolkit.engine.outputs import request_metrics
from toolkit.native import gpu_matmul, invariant_gpu, library
from toolkit.trace.schema import SCHEMA_VERSION, SampleTrace
from toolkit.version import __version__

ROOT = Path(__file__).resolve().parents[2]


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def build_manifest(engine, run_id: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    loaded = engine.loaded
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model_name": loaded.name,
        "model_id": loaded.model_id,
        "weights_sha256": loaded.revision,
        "tokenizer_sha256": loaded.tokenizer.digest if loaded.tokenizer else None,
        "dtype": str(loaded.model.embed.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "toolkit_version": __version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "engine": {k: getattr(engine.cfg, k) for k in engine.cfg.__dataclass_fields__},
        "num_kv_blocks": engine.num_kv_blocks,
        "scheduler_policy": engine.cfg.scheduler_policy,
        # no_chunking / prefill_first admit a prompt whole: a step may exceed max_num_batched_tokens for one
        "may_exceed_token_budget": engine.cfg.scheduler_policy in ("no_chunking", "prefill_first"),
        "attention_backend": engine.attention_backend,
        "matmul_backend": engine.matmul_backend,
        "precision": precision(
            loaded.model.embed.dtype,
            engine.cfg.kv_cache_dtype,
            engine.attention_backend,
            engine.matmul_backend,
            native_rowwise(engine),
            gpu=torch.device(engine.device).type == "cuda",
        ),  # which operation, which precision
        **native_kernels(engine),
        "kv_cache_dtype": engine.cfg.kv_cache_dtype,  # the KV storage every logit was computed from
        "kv_scale_granularity": engine.kv_cache.granularity,
        "kv_bytes_per_token": engine.kv_cache.bytes_per_token,
        "batch_invariant": engine.cfg.batch_invariant,  # bits comparable across batchings only when true
        **(extra or {}),
    }


def precision(
    dtype: torch.dtype, kv_cache_dtype: str, attention: str, matmul: str, native_rowwise: bool, gpu: bool = False
) -> dict[str, str]:
    """Which precision each part of a step runs in, for the manifest (docs/precision.md says the same);
    `native_rowwise`: RMSNorm, RoPE and SiLU ran on the native kernels (the CPU, where they build), or on a GPU
    (`gpu`) on the Triton kernels."""
    fmt = str(dtype).removeprefix("torch.")
    half = dtype != torch.float32
    cache = {"auto": fmt, "bf16": "bfloat16"}.get(kv_cache_dtype, f"{kv_cache_dtype} with fp32 scales")
    rounded = f", outputs rounded to {fmt}" if half else ""
    return {
        "weights": fmt,
        "activations": fmt + (" (every operation's outputs rounded to nearest, ties to even)" if half else ""),
        "matmul": (
            f"Triton: one fixed tiling, no split-K, tensor-core tile products summed in fp32{rounded}"
            if matmul == "native" and gpu
            else f"native: fp32 multiply-adds over {fmt} weights widened exactly, one FMA chain per element{rounded}"
            if matmul == "native"
            else f"torch.matmul in {fmt} (BLAS; 16-bit inputs accumulate in fp32)"
        ),
        "attention": (
            f"{'Triton' if gpu else 'native'} kernel: fp32 scores, online softmax and sums over the {cache} "
            f"cache{rounded}"
            if attention == "kernel"
            else f"torch {attention} in {fmt} over the {cache} cache (read in {fmt})"
        ),
        "norm_rope_silu": (
            f"{'Triton' if gpu else 'native'} kernels in fp32{rounded}"
            if native_rowwise
            else f"torch: RMSNorm statistics in fp32, the rest in {fmt}"
        ),
        "logits": f"{fmt}, widened to fp32" if half else "fp32",
        "sampling": "fp32 logits; log-softmax and processors in fp32",
    }


def native_rowwise(engine) -> bool:
    """Whether the step's RMSNorm, RoPE and SiLU ran on the native kernels (on the CPU, where they build), or on a
    CUDA GPU on the Triton kernels (where Triton imports)."""
    if torch.device(engine.device).type == "cuda":
        return invariant_gpu.triton is not None
    return torch.device(engine.device).type == "cpu" and library.available()


def native_kernels(engine) -> dict[str, Any]:
    """Which build of the native kernels the engine ran, and the profile its bits depend on (lanes, FMA);
    none when it ran torch's code only."""
    if engine.attention_backend != "kernel" and engine.matmul_backend != "native":
        return {"native_kernels": f"not used ({library.describe_native()})", "kernel_numerics": None}
    if torch.device(engine.device).type == "cuda":
        # the kernel backends on a GPU are Triton's (toolkit/native/invariant_gpu.py)
        gpu = torch.cuda.get_device_name(engine.device)
        major, minor = torch.cuda.get_device_capability(engine.device)
        # what the kernels' bits depend on: the compiler and the architecture it compiles for (replay compares it)
        numerics = f"triton {invariant_gpu.triton.__version__}, sm_{major}{minor}"
        if engine.matmul_backend == "native":  # the invariant matmul's tiling fixes its rows' sums
            numerics += ", matmul tiles " + gpu_matmul.describe_tiling(engine.loaded.model.embed.dtype)
        return {
            "native_kernels": f"Triton {invariant_gpu.triton.__version__} kernels on {gpu}",
            "kernel_numerics": numerics,
        }
    lib = library.native()
    schedule = engine.matmul_schedule
    return {
        "native_kernels": lib.profile.describe(),
        "kernel_numerics": lib.profile.numerics,
        "kernel_target": lib.profile.target,
        # the matmul's loops per class of rows and how they were chosen (they change no bit)
        "matmul_schedule": schedule.describe() if schedule is not None else None,
    }


def request_rows(engine, run_id: str, request_ids: Sequence[str]) -> list[dict[str, Any]]:
    """One row per sequence, with everything replay needs to rebuild it."""
    rows = []
    for rid in request_ids:
        for s in engine.sequences(rid):
            m = request_metrics(s)
            rows.append(
                {
                    "run_id": run_id,
                    "request_id": s.request_id,
                    "stream": s.stream,
                    "prompt_token_ids": list(s.prompt_token_ids),
                    "prompt_text": s.prompt_text,
                    "sampling_params": json.dumps(s.sampling.to_dict()),  # key order kept: a schema's is its grammar's
                    "seed": s.seed,
                    "arrival_step": s.arrival_step,
                    "admitted_step": s.admitted_step,
                    "output_token_ids": list(s.output_token_ids),
                    "output_text": s.text,
                    "finish_reason": s.finish_reason.value if s.finish_reason else None,
                    "stop_reason": s.finish_detail,
                    "num_preemptions": s.num_preemptions,
                    "preempted_steps": list(s.preempted_steps),
                    "preemption_modes": list(s.preemption_modes),
                    "priority": s.priority,
                    "queue_s": m.queue_s,
                    "ttft_s": m.ttft_s,
                    "grammar_kind": s.sampling.structured_outputs.kind if s.sampling.structured_outputs else None,
                    "grammar_sha256": s.sampling.structured_outputs.digest if s.sampling.structured_outputs else None,
                    "tpot_s": m.tpot_s,
                    "e2e_s": m.e2e_s,
                    "abort_step": s.abort_step,
                }
            )
    return rows


__all__ = ["SCHEMA_VERSION", "SampleTrace", "build_manifest", "new_run_id", "request_rows"]
