"""Start the server: `python run.py mode=serve [serve.port=8000] [model=...] [engine.*=...]`."""

from __future__ import annotations

import dataclasses
import gc
import ipaddress
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from omegaconf import DictConfig, OmegaConf

from toolkit.config import is_int
from toolkit.engine.core import Engine
from toolkit.errors import ConfigError
from toolkit.report import report_after, wanted
from toolkit.serve.api import Api
from toolkit.serve.connections import AbortingServer, http_protocol, listening_socket
from toolkit.serve.limits import Limits
from toolkit.serve.loop import EngineLoop
from toolkit.serve.metrics import ServerMetrics
from toolkit.serve.protocol import ServedModel


@dataclass
class Server:
    """A running server (uvicorn on a thread): its URL, engine loop and run directory; `stop()` shuts it down
    as SIGINT would (requests aborted, trace and summary written)."""

    url: str
    run_dir: Path | None
    loop: Any
    uvicorn: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)
        self.loop.stop()
        gc.unfreeze()


SERVE_DEFAULTS = {
    "host": "127.0.0.1",
    "port": 8000,
    "served_model_name": None,
    "log_level": "warning",
    "flush_every_steps": 8,
    "timeout_graceful_shutdown": 2,
    "max_waiting": 256,
    "api_key": None,
    "metrics_public": True,
    "record_body": "full",
    "limit_concurrency": 1024,
    "max_connections_per_client": 256,  # open connections from one address; past it a request gets 503 (null: none)
    "timeout_keep_alive": 5,
    "client_header_timeout_s": 10.0,  # a connection whose request line and headers are not whole by then: closed
    "max_header_kb": 64,  # a request line and headers past this: 431, the connection closed
    "max_trace_gb": None,
    "max_compiling": 8,
    "max_scoring": 4,  # echo + logprobs requests scoring or waiting to (one at a time); past it: 503
    "max_grammar_mb": 1024,  # memory one grammar's compile may take in its child process; past it: 400
    "handoff_wait_ms": None,  # None: the engine loop's default for its device (toolkit.serve.loop.handoff_wait_for)
    **dataclasses.asdict(Limits()),
}


def serve_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The serve section, checked: every key known, the port and limits in range. `api_key` may be one key
    or a list; TOOLKIT_API_KEY (comma-separated) adds to it."""
    section = cfg.get("serve") or {}
    section = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)
    unknown = sorted(set(section) - set(SERVE_DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown serve option(s) {', '.join(unknown)}; known: {', '.join(sorted(SERVE_DEFAULTS))}")
    section = {**SERVE_DEFAULTS, **{k: v for k, v in section.items() if v is not None}}
    port = section["port"]
    if not (isinstance(port, int) and 0 <= port < 65536):
        raise ConfigError(f"serve.port must be an integer in [0, 65535], got {port!r}")
    for name in (
        "max_waiting",
        "max_prompts",
        "max_sequences",
        "max_scoring",
        "max_stop",
        "max_stop_chars",
        "max_bad_words",
        "max_logit_bias",
        "max_user_chars",
        "max_metadata",
        "max_schema_depth",
        "max_schema_nodes",
        "max_schema_chars",
        "max_schema_pattern_cost",
        "limit_concurrency",
        "timeout_keep_alive",
        "max_compiling",
        "max_grammar_mb",
        "max_header_kb",
        "max_scored_tokens",
    ):
        if not (is_int(section[name]) and section[name] >= 1):
            raise ConfigError(f"serve.{name} must be a positive integer, got {section[name]!r}")
    for name, nullable in (
        ("max_body_mb", False),
        ("grammar_timeout_s", False),
        ("max_unread_mb", False),
        ("max_response_mb", False),
        ("stream_write_timeout_s", False),
        ("client_body_timeout_s", False),
        ("client_header_timeout_s", False),
        ("max_trace_gb", True),
    ):
        value = section[name]
        if not (
            (nullable and value is None)
            or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)
        ):
            raise ConfigError(f"serve.{name} must be a positive number{' or null' if nullable else ''}, got {value!r}")
    per_client = section["max_connections_per_client"]
    if not (per_client is None or (is_int(per_client) and per_client >= 1)):
        raise ConfigError(f"serve.max_connections_per_client must be a positive integer or null, got {per_client!r}")
    flush = section["flush_every_steps"]
    if not (is_int(flush) and 1 <= flush <= 64):
        raise ConfigError(f"serve.flush_every_steps must be an integer in [1, 64], got {flush!r}")
    wait = section["handoff_wait_ms"]
    if not (wait is None or (isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 <= wait <= 1000)):
        raise ConfigError(f"serve.handoff_wait_ms must be a number in [0, 1000] or null, got {wait!r}")
    keys = section["api_key"]
    keys = [keys] if isinstance(keys, str) else list(keys or [])
    keys += [k for k in os.environ.get("TOOLKIT_API_KEY", "").split(",") if k.strip()]
    if not all(isinstance(k, str) and k.strip() for k in keys):
        raise ConfigError("serve.api_key must be a non-empty string or a list of them")
    section["api_key"] = [k.strip() for k in keys]
    return section


EXIT_LOOP_FAILED = 70  # mode=serve's exit code when its engine loop could not go on (EX_SOFTWARE)


def build(
    engine: Engine,
    run_dir: Path | None,
    cfg: Mapping[str, Any] | None,
    section: Mapping[str, Any],
    on_fatal: Callable[[BaseException], None] | None = None,
):
    """The engine loop (started) and the FastAPI app over it; `section`: serve_config's; `on_fatal`: the loop's
    (EngineLoop)."""
    name = section["served_model_name"] or engine.loaded.name
    served = ServedModel(
        name=name,
        aliases=tuple({engine.loaded.name, engine.loaded.model_id} - {name}),
        max_model_len=engine.max_model_len,
    )
    metrics_box: dict[str, Any] = {}
    loop = EngineLoop(
        engine,
        run_dir,
        cfg,
        flush_every_steps=int(section["flush_every_steps"]),
        on_finish=lambda out: metrics_box["m"].finished(out),
        max_waiting=section["max_waiting"],
        record_body=section["record_body"],
        max_trace_bytes=None if section["max_trace_gb"] is None else int(section["max_trace_gb"] * 2**30),
        on_fatal=on_fatal,
        handoff_wait_ms=section["handoff_wait_ms"],
    )
    metrics_box["m"] = metrics = ServerMetrics(loop, name)
    limits = Limits(**{f.name: section[f.name] for f in dataclasses.fields(Limits)})
    api = Api(
        loop,
        served,
        metrics,
        on_shutdown=loop.stop,
        limits=limits,
        api_keys=section["api_key"],
        metrics_public=bool(section["metrics_public"]),
        max_compiling=section["max_compiling"],
        max_scoring=section["max_scoring"],
        max_grammar_mb=section["max_grammar_mb"],
    )
    if not section["api_key"] and not _loopback(section["host"]):
        print(
            f"warning: serving on {section['host']} without an API key: anyone who can reach this port can use "
            f"it (set serve.api_key or TOOLKIT_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    # the startup heap (torch, the model, the tokenizer: ~200k objects) is frozen, as vLLM's engine does: each
    # collection then scans what requests allocated, not all of it (a body of a million lists parsed 0.9 s -> 0.13 s)
    gc.collect()
    gc.freeze()
    loop.start()
    return loop, api.app


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _uvicorn_config(app, host: str, port: int, section: Mapping[str, Any]):
    """uvicorn's settings: past `limit_concurrency` open connections a new one gets 503; an idle keep-alive
    connection is closed after `timeout_keep_alive` seconds, one whose request head has not all come
    `client_header_timeout_s` after it opened (or after its last answer) too, and the 503 is OpenAI's
    (toolkit.serve.connections)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=http_protocol(
            section["client_header_timeout_s"],
            section["limit_concurrency"],
            section["max_header_kb"] * 1024,
            section["max_connections_per_client"],
        ),
        h11_max_incomplete_event_size=section["max_header_kb"] * 1024,  # where h11 parses (no httptools)
        log_level=section["log_level"],
        timeout_graceful_shutdown=section["timeout_graceful_shutdown"],
        lifespan="on",
        limit_concurrency=section["limit_concurrency"],
        timeout_keep_alive=section["timeout_keep_alive"],
    )


def start_server(
    engine: Engine,
    run_dir: Path | None,
    cfg: Mapping[str, Any] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    **section: Any,
) -> Server:
    """Serve `engine` on a background thread (port 0: a free port); returns once it accepts connections."""
    section = serve_config({"serve": {**section, "host": host, "port": port}})
    loop, app = build(engine, run_dir, cfg, section)
    server = uvicorn.Server(_uvicorn_config(app, host, port, section))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            loop.stop()
            raise ConfigError(f"the server did not start on {host}:{port} (is the port in use?)")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return Server(url=f"http://{host}:{bound}", run_dir=run_dir, loop=loop, uvicorn=server, thread=thread)


def serving_engine(cfg: DictConfig) -> DictConfig:
    """`cfg` with the engine as a server runs it (recorded so, for replay): engine.max_chunk_tokens null becomes
    half the step budget, so a long prompt's prefill leaves room in every step for the requests that come after it
    (vLLM's long_prefill_token_threshold; its server's defaults differ from its offline engine's too). An
    8,000-token prompt held a 3-token one behind its whole prefill, 27 s, and made steps of up to 2.75 s; at half
    the budget it waits one step and steps take up to 1.5 s, the long prompt's own prefill as long (SmolLM2,
    AMD EPYC (avx2 avx512f )). engine.dynamic_chunking null becomes auto: the chunks shrink as their context grows,
    and the slowest step beside an 8,000-token prompt went from 3.2-4.0 s to 1.1-1.3 s (AMD EPYC (avx2 ); docs/serving.md).
    engine.scheduling_policy null becomes priority: with the i-th prompt of a request at
    priority i (toolkit.serve.job), a request of 64 prompts no longer holds every slot until its last one ends."""
    engine = cfg.get("engine")
    if engine is not None and engine.get("max_chunk_tokens") is None:
        budget = engine.get("max_num_batched_tokens")
        if is_int(budget) and budget >= 2:
            engine.max_chunk_tokens = budget // 2
    if engine is not None and engine.get("dynamic_chunking") is None:
        engine.dynamic_chunking = "auto"  # a long prompt's chunks shrink as its context grows: steps stay short
    if engine is not None and engine.get("scheduling_policy") is None:
        engine.scheduling_policy = "priority"  # one request's many prompts or samples take turns with others'
    return cfg


def run_serve(cfg: DictConfig, run_dir: Path) -> int:
    """The server in the foreground until SIGINT / SIGTERM; the run directory is closed cleanly then."""
    section = serve_config(cfg)
    host, port = section["host"], section["port"]
    sock = listening_socket(host, port)  # before the model loads: an address it cannot take is one line
    port = sock.getsockname()[1]  # serve.port=0: the one the system chose
    try:
        engine = Engine.from_config(serving_engine(cfg))
    except BaseException:
        sock.close()
        raise
    servers: list[uvicorn.Server] = []  # the loop's failure shuts the HTTP server down (on any thread)
    loop, app = build(
        engine, run_dir, cfg, section, on_fatal=lambda exc: [setattr(s, "should_exit", True) for s in servers]
    )
    print(
        f"serving {engine.loaded.name} at http://{host}:{port}/v1 (OpenAI API); trace: {run_dir}",
        file=sys.stderr,
        flush=True,
    )
    config = _uvicorn_config(app, host, port, section)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then re-raises the signal to the handlers it found:
    # ours only note it, so the run directory is closed and the process exits 0 instead of dying of it
    caught: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda number, frame: caught.append(number)) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    servers.append(AbortingServer(config, on_exit=lambda: loop.abort(None)))
    try:
        if loop.error is None:  # (a loop that failed before the server existed had no server to stop)
            servers[0].run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    loop.stop()
    gc.unfreeze()  # (a frozen heap is never finalized: native bindings then report leaks at exit)
    if loop.error is not None:  # every waiting client was answered; a supervisor restarts a fresh process
        print(
            f"serve: the engine loop stopped ({type(loop.error).__name__}: {loop.error}); exiting "
            f"{EXIT_LOOP_FAILED} so a supervisor restarts the server",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_LOOP_FAILED

    if wanted(cfg):  # the served run as a page, once it is closed
        page = report_after(run_dir)
        if page is not None:
            print(f"see it: {page} (open it in a browser)", file=sys.stderr)
    print(
        f"stopped; replay it bit for bit:  python run.py mode=replay replay.trace={run_dir}\n"
        f"verify its logits:              python run.py mode=verify verify.trace={run_dir}",
        file=sys.stderr,
    )
    return 0
