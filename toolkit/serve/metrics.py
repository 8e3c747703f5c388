"""What `GET /metrics` reports, in Prometheus' text format (prometheus_client, on a registry of this server's
own: nothing global)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from toolkit.engine.outputs import RequestOutput
from toolkit.serve.loop import EngineLoop

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads the engine loop's counters when scraped."""

    def __init__(self, loop: EngineLoop, model: str):
        self.loop, self.model = loop, model

    def collect(self):
        s = self.loop.stats
        labels = ["model_name"]
        for name, doc, value in (
            ("toolkit_num_requests_running", "Sequences in the running batch.", s.running),
            ("toolkit_num_requests_waiting", "Sequences waiting to be admitted.", s.waiting),
            ("toolkit_kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used),
            ("toolkit_kv_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total),
            (
                "toolkit_kv_cache_usage_perc",
                "Fraction of KV blocks in use.",
                s.kv_blocks_used / max(s.kv_blocks_total, 1),
            ),
            (
                "toolkit_output_tokens_per_second",
                "Output tokens per second over the last 10 seconds.",
                s.tokens_per_s(),
            ),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model], value)
            yield g
        for name, doc, value in (
            ("toolkit_generation_tokens", "Output tokens sampled.", s.output_tokens),
            ("toolkit_prompt_tokens", "Prompt tokens of finished requests.", s.prompt_tokens),
            ("toolkit_engine_steps", "Engine steps run (one forward each).", s.steps),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model], value)
            yield c
        done = CounterMetricFamily(
            "toolkit_request_success", "Finished sequences by finish reason.", labels=labels + ["finished_reason"]
        )
        for reason, count in sorted(s.finished.items()):
            done.add_metric([self.model, str(reason)], count)
        yield done


class ServerMetrics:
    def __init__(self, loop: EngineLoop, model: str):
        self.registry = CollectorRegistry()
        self.model = model
        self.registry.register(_EngineCollector(loop, model))
        self.ttft = Histogram(
            "toolkit_time_to_first_token_seconds",
            "Time to first token (arrival to first token).",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "toolkit_time_per_output_token_seconds",
            "Mean time between output tokens.",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "toolkit_e2e_request_latency_seconds",
            "Arrival to finish.",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.http = Counter(
            "toolkit_http_requests", "HTTP requests by route and status.", ["route", "status"], registry=self.registry
        )

    def finished(self, output: RequestOutput) -> None:
        """Called on the engine thread with each finished request."""
        for c in output.outputs:
            m = c.metrics
            if m.ttft_s is not None:
                self.ttft.labels(self.model).observe(m.ttft_s)
            if m.tpot_s is not None:
                self.tpot.labels(self.model).observe(m.tpot_s)
            if m.e2e_s is not None:
                self.e2e.labels(self.model).observe(m.e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
