"""An OpenAI-compatible server over the engine: `python run.py mode=serve` (or `make serve`).

    toolkit.serve.loop      EngineLoop: the one thread that owns the Engine (admission bound, faults per request)
    toolkit.runs.recorder   RunRecorder: what the loop records (as every run does), append-only and in bounded memory
    toolkit.serve.protocol  the request bodies (pydantic), refused fields named
    toolkit.serve.api       the FastAPI routes: parse, submit, await updates, answer (JSON or SSE)
    toolkit.serve.metrics   /metrics in Prometheus' format
    toolkit.serve.main      run_serve: config -> engine -> loop -> uvicorn; start_server for tests and the bench
    toolkit.modes.serve_soak      soak_http: an overload burst, then thousands of requests over loopback HTTP

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client).
"""
