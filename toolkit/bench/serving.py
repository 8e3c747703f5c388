"""The serving benchmark: the same requests through `LLM.generate` and through the HTTP server, side by side.

    python run.py mode=bench bench.systems=[] bench.roofline=false bench.sampled_variants=null \
        bench.host_work_batch=null bench.serving=true [bench.serving_clients=32]

N concurrent clients (the real `openai` client, streaming, in a separate process as real clients are) send the
workload's requests with staggered starts; each client sends its next request when its last one is done. The
report has requests/s, output tok/s, TTFT and TPOT p50/p95/p99 as the clients saw them, and the HTTP overhead:
1 - (HTTP output tok/s) / (LLM.generate output tok/s) over the same requests (greedy, ignore_eos, so both
produce exactly the same tokens), both traced.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolkit.engine.core import Engine
from toolkit.runs.metrics import percentile
from toolkit.sampling.params import SamplingParams
from toolkit.serve.main import start_server


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 95, 99)}


def measure(
    llm, prompts: list[list[int]], max_tokens: int, clients: int, stagger_s: float, run_dir: Path
) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    direct_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    engine = Engine(llm.loaded, llm.engine_cfg, llm.default_sampling)
    server = start_server(engine, run_dir / "serving_trace", {"model": {"name": llm.loaded.name}})
    try:
        spec = {
            "url": server.url,
            "prompts": prompts,
            "max_tokens": max_tokens,
            "clients": clients,
            "stagger_s": stagger_s,
            "model": llm.loaded.name,
        }
        done = subprocess.run(
            [sys.executable, "-m", "toolkit.bench.serving"],
            input=json.dumps(spec),
            text=True,
            capture_output=True,
            timeout=3600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"serving clients failed: {done.stderr.strip().splitlines()[-1:]}")
        seen = json.loads(done.stdout)
    finally:
        server.stop()
    http_tokens = sum(seen["tokens"])
    direct_tok_s, http_tok_s = tokens / direct_s, http_tokens / seen["wall_s"]
    same = [o.outputs[0].text for o in outs] == seen["texts"] and [len(o.outputs[0].token_ids) for o in outs] == seen[
        "tokens"
    ]
    return {
        "clients": clients,
        "requests": len(prompts),
        "max_tokens": max_tokens,
        "stagger_s": stagger_s,
        "llm_generate": {
            "wall_s": direct_s,
            "output_tokens": tokens,
            "output_tok_per_s": direct_tok_s,
            "requests_per_s": len(prompts) / direct_s,
        },
        "http": {
            "wall_s": seen["wall_s"],
            "output_tokens": http_tokens,
            "output_tok_per_s": http_tok_s,
            "requests_per_s": len(prompts) / seen["wall_s"],
            "ttft_s": _quantiles(seen["ttft_s"]),
            "tpot_s": _quantiles(seen["tpot_s"]),
        },
        "http_overhead": 1 - http_tok_s / direct_tok_s,
        "same_outputs": same,  # the same text and token counts both ways
    }


def _client(url: str):
    import openai  # deferred: the openai client, a test dependency

    # a connection per request ("Connection: close"): llama-server (cpp-httplib) closes an idle kept-alive connection
    # just as the next request reuses it ("Server disconnected without sending a response"), and no retry hides it
    return openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=3600,
        default_headers={"Connection": "close"},
    )


async def _request(client, spec: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """One streamed completion: its wall time, TTFT, TPOT (None under two tokens), text and token count."""
    start = time.perf_counter()
    first = last = None
    text, tokens = "", 0
    stream = await client.completions.create(
        model=spec["model"],
        prompt=prompt,
        max_tokens=spec["max_tokens"],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else now
            last = now
            text += chunk.choices[0].text
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {
        "wall_s": end - start,
        "ttft_s": (first or end) - start,
        "tpot_s": (last - first) / (tokens - 1) if first is not None and tokens > 1 else None,
        "text": text,
        "tokens": tokens,
    }


def _seen(results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    return {
        "wall_s": wall_s,
        "tokens": [r["tokens"] for r in results],
        "ttft_s": [r["ttft_s"] for r in results],
        "tpot_s": [r["tpot_s"] for r in results if r["tpot_s"] is not None],
        "texts": [r["text"] for r in results],
        "request_s": [r["wall_s"] for r in results],
    }


async def _clients(spec: dict[str, Any]) -> dict[str, Any]:
    """`clients` clients, each sending its next request when its last one is done (the k-th starting after k
    staggers)."""
    client = _client(spec["url"])
    prompts = spec["prompts"]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[dict[str, Any]] = [{}] * len(prompts)

    async def worker(k: int) -> None:
        await asyncio.sleep(k * spec["stagger_s"])
        while not queue.empty():
            i = queue.get_nowait()
            results[i] = await _request(client, spec, prompts[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(spec["clients"])))
    return _seen(results, time.perf_counter() - t0)


async def _interleaved(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Each prompt to every server in `urls` in turn, one request at a time (the order rotated a prompt), so a
    drift of the machine falls on every server within seconds: what each server saw, its wall time the sum of its
    requests'."""
    urls = spec["urls"]
    clients = [_client(url) for url in urls]
    results: list[list[dict[str, Any]]] = [[] for _ in urls]
    for i, prompt in enumerate(spec["prompts"]):
        for j in [(i + k) % len(urls) for k in range(len(urls))]:
            results[j].append(await _request(clients[j], spec, prompt))
    return [_seen(r, sum(x["wall_s"] for x in r)) for r in results]


if __name__ == "__main__":  # the client process: a spec on stdin, what the clients saw on stdout
    spec = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(_interleaved(spec) if "urls" in spec else _clients(spec))))
