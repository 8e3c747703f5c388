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


async def _clients(spec: dict[str, Any]) -> dict[str, Any]:
    import openai  # deferred: the openai client, a test dependency

    # a connection per request ("Connection: close"): llama-server (cpp-httplib) closes an idle kept-alive connection
    # just as the next request reuses it ("Server disconnected without sending a response"), and no retry hides it
    client = openai.AsyncOpenAI(
        base_url=spec["url"] + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=3600,
        default_headers={"Connection": "close"},
    )
    prompts = spec["prompts"]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    ttft: list[float] = [0.0] * len(prompts)
    tpot: list[float | None] = [None] * len(prompts)
    texts = [""] * len(prompts)
    tokens = [0] * len(prompts)

    async def one(i: int) -> None:
        start = time.perf_counter()
        first = last = None
        stream = await client.completions.create(
            model=spec["model"],
            prompt=prompts[i],
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
                texts[i] += chunk.choices[0].text
            if chunk.usage is not None:
                tokens[i] = chunk.usage.completion_tokens
        ttft[i] = (first or time.perf_counter()) - start
        tpot[i] = (last - first) / (tokens[i] - 1) if first is not None and tokens[i] > 1 else None

    async def worker(k: int) -> None:
        await asyncio.sleep(k * spec["stagger_s"])
        while not queue.empty():
            await one(queue.get_nowait())

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(spec["clients"])))
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "tokens": tokens,
        "ttft_s": ttft,
        "tpot_s": [t for t in tpot if t is not None],
        "texts": texts,
    }


if __name__ == "__main__":  # the client process: a spec on stdin, what the clients saw on stdout
    print(json.dumps(asyncio.run(_clients(json.loads(sys.stdin.read())))))
