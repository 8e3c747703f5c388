"""Start the server: `python run.py mode=serve [serve.port=8000] [model=...] [engine.*=...]`."""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from toolkit.engine import Engine
from toolkit.errors import ConfigError


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


def serve_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    section = cfg.get("serve") or {}
    section = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)
    known = {"host", "port", "served_model_name", "log_level", "flush_every_steps", "timeout_graceful_shutdown"}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"unknown serve option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    port = section.get("port", 8000)
    if not (isinstance(port, int) and 0 <= port < 65536):
        raise ConfigError(f"serve.port must be an integer in [0, 65535], got {port!r}")
    return section


def build(engine: Engine, run_dir: Path | None, cfg: Mapping[str, Any] | None, section: Mapping[str, Any]):
    """The engine loop (started) and the FastAPI app over it."""
    from toolkit.serve.api import Api, ServedModel
    from toolkit.serve.loop import EngineLoop
    from toolkit.serve.metrics import ServerMetrics

    name = section.get("served_model_name") or engine.loaded.name
    served = ServedModel(name=name, aliases=tuple({engine.loaded.name, engine.loaded.model_id} - {name}),
                         max_model_len=engine.max_model_len)
    metrics_box: dict[str, Any] = {}
    loop = EngineLoop(engine, run_dir, cfg, flush_every_steps=int(section.get("flush_every_steps", 8)),
                      on_finish=lambda out: metrics_box["m"].finished(out))
    metrics_box["m"] = metrics = ServerMetrics(loop, name)
    api = Api(loop, served, metrics, on_shutdown=loop.stop)
    loop.start()
    return loop, api.app


def _uvicorn_config(app, host: str, port: int, section: Mapping[str, Any]):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=section.get("log_level", "warning"),
                          timeout_graceful_shutdown=section.get("timeout_graceful_shutdown", 2), lifespan="on")


def start_server(engine: Engine, run_dir: Path | None, cfg: Mapping[str, Any] | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, **section: Any) -> Server:
    """Serve `engine` on a background thread (port 0: a free port); returns once it accepts connections."""
    import uvicorn

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


def run_serve(cfg: DictConfig, run_dir: Path) -> int:
    """The server in the foreground until SIGINT / SIGTERM; the run directory is closed cleanly then."""
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("mode=serve needs the serve extra: pip install -e '.[serve]' -c constraints.txt") from None

    section = serve_config(cfg)
    engine = Engine.from_config(cfg)
    loop, app = build(engine, run_dir, cfg, section)
    host, port = section.get("host", "127.0.0.1"), section.get("port", 8000)
    print(f"serving {engine.loaded.name} at http://{host}:{port}/v1 (OpenAI API); trace: {run_dir}", file=sys.stderr,
          flush=True)
    config = _uvicorn_config(app, host, port, section)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then re-raises the signal to the handlers it found:
    # ours only note it, so the run directory is closed and the process exits 0 instead of dying of it
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda number, frame: caught.append(number))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    loop.stop()
    if loop.error is not None:
        raise loop.error
    from toolkit.report import report_after, wanted

    if wanted(cfg):  # the served run as a page, once it is closed
        page = report_after(run_dir)
        if page is not None:
            print(f"see it: {page} (open it in a browser)", file=sys.stderr)
    print(f"stopped; replay it bit for bit:  python run.py mode=replay replay.trace={run_dir}\n"
          f"verify its logits:              python run.py mode=verify verify.trace={run_dir}", file=sys.stderr)
    return 0
