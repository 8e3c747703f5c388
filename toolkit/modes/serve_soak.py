"""mode=soak soak.over=http: the server driven over loopback HTTP with many thousands of short requests.

    python run.py experiment=serve_soak                      # 20,000 requests on the tiny model
    python run.py experiment=serve_soak soak.requests=2000   # a short one

First a burst of requests at once (the overload check: every answer 200 or 503). Then a fixed number of
clients (`concurrency`) send completions with random short prompts, sampling and seeds; a
503 is retried after its Retry-After. After every `report_every` requests served it prints the process's RSS,
the trace writer's flush time for that thousand and the requests the loop still holds. At the end it checks
that nothing was lost (requests.parquet rows == requests served, samples rows == tokens answered) and replays
the run bit for bit. The figures go to soak_http.json in the run directory; the exit code says whether all held.
Ctrl-C or SIGTERM stops the clients (the requests in flight are answered first) and skips the replay: the server's
trace closed, soak_http.json written with what was measured so far and `interrupted`, exit 130 (143 for SIGTERM).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from toolkit.engine.core import Engine
from toolkit.reproduce.replay import replay as replay_run
from toolkit.runs.signals import StopRequest, stop_between_steps
from toolkit.serve.main import start_server
from toolkit.trace.reader import read_requests, read_samples

WORDS = (
    "the",
    "cat",
    "river",
    "sang",
    "over",
    "a",
    "quiet",
    "moon",
    "and",
    "seven",
    "red",
    "boats",
    "under",
    "green",
    "light",
    "to",
    "market",
    "was",
    "cold",
    "we",
)


def soak_http(
    engine: Engine,
    run_dir: Path,
    config: dict[str, Any] | None = None,
    *,
    requests: int = 20000,
    concurrency: int = 32,
    max_tokens: int = 4,
    report_every: int = 1000,
    seed: int = 0,
    max_waiting: int = 256,
    burst: int = 0,
    replay: bool = True,
) -> dict[str, Any]:
    """`burst`: first send that many requests at once (each 16 tokens long), the overload check: every answer
    must be 200 or 503, /health 200 afterwards."""
    for name in ("httpx", "httpcore"):  # a line per HTTP request under Hydra's INFO logging
        logging.getLogger(name).setLevel(logging.WARNING)
    served_dir = Path(run_dir) / "served"
    server = start_server(engine, served_dir, config, max_waiting=max_waiting)
    proc = psutil.Process()
    rows: list[dict[str, Any]] = []
    counts = {"served": 0, "tokens": 0, "retried_503": 0, "errors": 0, "burst_served": 0}
    report_burst: dict[str, Any] = {}
    start = time.perf_counter()
    flushed = [0.0]
    stop = StopRequest()

    def checkpoint() -> None:
        writer = server.loop.writer
        rows.append(
            {
                "served": counts["served"],
                "seconds": time.perf_counter() - start,
                "rss_mb": proc.memory_info().rss / 2**20,
                "flush_s": writer.flush_s - flushed[0],
                "open_requests": server.loop.open_requests,
            }
        )
        flushed[0] = writer.flush_s
        r = rows[-1]
        print(
            f"served {r['served']:>6}: RSS {r['rss_mb']:.0f} MB, flush {r['flush_s'] * 1e3:.0f} ms this "
            f"{report_every}, {r['open_requests']} open, {r['seconds']:.0f} s",
            flush=True,
        )

    async def one(client: httpx.AsyncClient, rnd: random.Random) -> None:
        body = {
            "prompt": " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, 12))),
            "max_tokens": max_tokens,
            "temperature": rnd.choice([0.0, 0.7, 1.0]),
            "seed": rnd.randrange(2**31),
        }
        while True:
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 503:
                break
            counts["retried_503"] += 1
            await asyncio.sleep(float(r.headers.get("retry-after", "1")) / 10)
        if r.status_code != 200:
            counts["errors"] += 1
            return
        counts["served"] += 1
        counts["tokens"] += r.json()["usage"]["completion_tokens"]
        if counts["served"] % report_every == 0:
            checkpoint()

    async def overload() -> None:
        body = {"prompt": "Overload", "max_tokens": 16, "ignore_eos": True, "temperature": 1.0}
        async with httpx.AsyncClient(
            base_url=server.url, limits=httpx.Limits(max_connections=burst), timeout=300
        ) as client:
            t0 = time.perf_counter()
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json={**body, "seed": i}) for i in range(burst)),
                return_exceptions=True,
            )
            statuses = [a.status_code if isinstance(a, httpx.Response) else type(a).__name__ for a in answers]
            health = (await client.get("/health")).status_code
        by = {str(k): statuses.count(k) for k in sorted(set(statuses), key=str)}
        counts["burst_served"] = statuses.count(200)
        counts["tokens"] += 16 * statuses.count(200)
        report_burst.update(statuses=by, health_after=health, seconds=time.perf_counter() - t0)
        print(
            f"overload: {burst} requests at once against serve.max_waiting={max_waiting}: {by} in "
            f"{report_burst['seconds']:.1f} s; /health {health} afterwards",
            flush=True,
        )

    async def drive() -> None:
        if burst:
            await overload()
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            left = iter(range(requests))

            async def worker(k: int) -> None:
                rnd = random.Random(seed * 1000 + k)
                for _ in left:
                    if stop.pressed:  # Ctrl-C, SIGTERM: no new request; those in flight are answered
                        return
                    await one(client, rnd)

            await asyncio.gather(*(worker(k) for k in range(concurrency)))

    try:
        with stop_between_steps() as stop:
            asyncio.run(drive())
    except KeyboardInterrupt:  # a second signal: the requests in flight were cancelled; what was served is written
        stop.pressed = True
    finally:
        server.stop()  # the served trace closed
    recorded = read_requests(served_dir).num_rows
    sample_rows = read_samples(served_dir).num_rows
    report: dict[str, Any] = {
        **counts,
        "requests": requests,
        "seconds": time.perf_counter() - start,
        "checkpoints": rows,
        "trace_requests": recorded,
        "trace_sample_rows": sample_rows,
        "burst": report_burst,
    }
    problems = []
    if counts["errors"]:
        problems.append(f"{counts['errors']} requests answered neither 200 nor 503")
    if set(report_burst.get("statuses", {})) - {"200", "503"} or report_burst.get("health_after", 200) != 200:
        problems.append(f"overload: {report_burst}")
    served = counts["served"] + counts["burst_served"]
    if recorded != served:
        problems.append(f"requests.parquet holds {recorded} requests, {served} were served")
    if sample_rows != counts["tokens"]:
        problems.append(f"samples.parquet holds {sample_rows} rows, {counts['tokens']} tokens were answered")
    if len(rows) >= 2:  # from the second checkpoint (the first includes warm-up) to the last
        second, last = rows[1], rows[-1]
        report["rss_growth_mb"] = last["rss_mb"] - second["rss_mb"]
        report["flush_last_over_second"] = last["flush_s"] / max(second["flush_s"], 1e-9)
    if replay and not stop.pressed:
        replayed = replay_run(served_dir, out_dir=Path(run_dir) / "replayed")
        report["replay"] = replayed.summary_line()
        if not replayed.identical:
            problems.append(f"replay: {replayed.summary_line()}")
    report["problems"] = problems
    report["passed"] = not problems and not stop.pressed
    if stop.pressed:
        report.update(interrupted=True, signal=stop.name)
    (Path(run_dir) / "soak_http.json").write_text(json.dumps(report, indent=2))
    if stop.pressed:
        raise stop.interrupted(
            f"soak over HTTP interrupted after {served} requests served, {report['seconds']:.0f} s ({stop.name}): "
            f"trace closed ({sample_rows} sample rows), replay skipped, soak_http.json written in {run_dir}"
        )
    return report
