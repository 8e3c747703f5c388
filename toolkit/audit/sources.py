"""Transcripts from the engines this machine can run, for `mode=audit audit.sources=[...]`
(experiments/engine_mismatch.yaml) and the audit's end-to-end tests:

- `hf`: HF transformers `generate` on the same weights (format hf, via save_hf_generate);
- `server`: our OpenAI-compatible server, driven by the `openai` client (format openai);
- `server_bf16`: the same server running the model in bfloat16 (`model.dtype=bfloat16`): a transcript whose
  precision is not the stated one, for the detector (toolkit.audit.detector);
- `llama_cpp`: llama.cpp through llama-cpp-python on the original Q4_1 GGUF, its
  `create_completion(..., logprobs=k)` (format openai; another precision: the error is not zero).

Each writes one JSONL file and returns its format. Every source gets the same chat prompts,
greedy (temperature 0) unless `sampling` says otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from toolkit.audit.transcripts import save_hf_generate
from toolkit.models.loading import hf_reference_model, load_checkpoint
from toolkit.native.child import run_in_child

SOURCES = ("hf", "server", "server_bf16", "llama_cpp")
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash function is in two sentences.",
    "List three prime numbers and say why they are prime.",
)


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot run here (None: it can). Asked without importing it: its native library is loaded
    only in the child process that runs it (toolkit.native.child)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (make test builds it; pip install llama-cpp-python==0.3.36)"
    return None


def hf_transcript(
    path: Path,
    loaded,
    prompts: Sequence[list[int]],
    max_tokens: int,
    top_logprobs: int = 5,
    sampling: dict[str, Any] | None = None,
) -> str:

    model = hf_reference_model(load_checkpoint(loaded.config))
    eos = list(loaded.arch.eos_token_ids)
    kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": bool(sampling)}
    if sampling:
        kwargs.update({k: v for k, v in sampling.items() if k in ("temperature", "top_p", "top_k")})
    torch.manual_seed(0)
    path.write_text("")
    for i, prompt in enumerate(prompts):
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            return_dict_in_generate=True,
            output_logits=True,
            output_scores=True,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **kwargs,
        )
        save_hf_generate(
            path,
            out,
            [prompt],
            generation_kwargs=kwargs,
            eos_token_id=eos,
            top_logprobs=top_logprobs,
            request_ids=[f"hf-{i}"],
            append=True,
        )
    return "hf"


def server_transcript(
    path: Path,
    engine,
    messages: Sequence[str],
    max_tokens: int,
    top_logprobs: int = 5,
    sampling: dict[str, Any] | None = None,
) -> str:
    """Chat and text completions from our server through the openai client, as {request, response} lines."""
    import openai  # deferred: the openai client, only for this source

    from toolkit.serve.main import start_server  # deferred: toolkit.serve needs the [serve] extra (FastAPI)

    for name in ("httpx", "httpx2", "openai"):  # a line per HTTP request under Hydra's INFO logging
        logging.getLogger(name).setLevel(logging.WARNING)

    server = start_server(engine, None)
    lines = []
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        extra = dict(sampling or {"temperature": 0.0})
        for i, content in enumerate(messages):
            if i % 2 == 0:
                body = {
                    "model": engine.loaded.name,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": max_tokens,
                    "logprobs": True,
                    "top_logprobs": top_logprobs,
                    **extra,
                }
                response = client.chat.completions.create(**body)
            else:
                body = {
                    "model": engine.loaded.name,
                    "prompt": content,
                    "max_tokens": max_tokens,
                    "logprobs": top_logprobs,
                    **extra,
                }
                response = client.completions.create(**body)
            lines.append(
                json.dumps({"request": body, "response": response.model_dump(), "origin_engine": "toolkit server"})
            )
    finally:
        server.stop()
    path.write_text("".join(line + "\n" for line in lines))
    return "openai"


def llama_cpp_transcript(
    path: Path,
    gguf: Path,
    prompts: Sequence[list[int]],
    max_tokens: int,
    top_logprobs: int = 5,
    threads: int = 2,
    sampling: dict[str, Any] | None = None,
    timeout: float = 1800,
) -> str:
    """llama.cpp's own completions of the prompts' token ids (no BOS is added to a token list), made in a child
    process: a crash there is a ForeignEngineError naming the signal."""
    run_in_child(
        _llama_cpp_transcript,
        path,
        gguf,
        [list(p) for p in prompts],
        max_tokens,
        top_logprobs,
        threads,
        sampling,
        what="llama.cpp",
        timeout=timeout,
    )
    return "openai"


def _llama_cpp_transcript(
    path: Path,
    gguf: Path,
    prompts: list[list[int]],
    max_tokens: int,
    top_logprobs: int,
    threads: int,
    sampling: dict[str, Any] | None,
) -> None:
    from llama_cpp import Llama  # deferred: llama_cpp, the [llama] extra

    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, logits_all=True, verbose=False, seed=0)
    lines = []
    for prompt in prompts:
        body = {
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "logprobs": top_logprobs,
            **(sampling or {"temperature": 0.0, "top_k": 1}),
        }
        response = llm.create_completion(**body)
        lines.append(
            json.dumps(
                {"request": body, "response": response, "origin_engine": f"llama.cpp (llama-cpp-python, {gguf.name})"},
                default=float,
            )
        )  # its logprobs are numpy float32
    path.write_text("".join(line + "\n" for line in lines))
