"""`kiln serve`'s /metrics: Prometheus text format, with vLLM's metric names under kiln's prefix.

What the engine counts is read when Prometheus scrapes (running and waiting requests, KV cache use, prompt
tokens computed, preemptions): no bookkeeping per step. What only the HTTP side sees is observed as it happens:
requests by route and status, generated tokens, each finished request by its finish reason, and the latencies
a client feels, time to first token and between tokens. Each server has its own registry.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "kiln:"
# vLLM's buckets for these two histograms (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)


class EngineCollector:
    """The engine's own counters, read at scrape time (a snapshot across threads, as /health reads them)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s, pool = self.engine.scheduler, self.engine.pool
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests holding KV blocks, stepped every step",
                                value=len(s.running))
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests queued for admission",
                                value=len(s.waiting))
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Share of the KV cache's blocks in use (0 to 1)",
                                value=pool.in_use() / max(pool.num_blocks, 1))
        yield CounterMetricFamily(PREFIX + "prompt_tokens", "Prompt tokens computed (a cached prefix is not)",
                                  value=s.prefill_tokens)
        yield CounterMetricFamily(PREFIX + "num_preemptions", "Requests preempted for KV blocks", value=s.preemptions)


class ServeMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP requests answered, by route and status",
                                     ["path", "status"], registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated and sent to clients",
                                         registry=self.registry)
        self.request_success = Counter(PREFIX + "request_success", "Choices finished, by finish reason",
                                       ["finished_reason"], registry=self.registry)
        self.grammars = Counter(PREFIX + "structured_output_grammars", "Grammars requests asked for: compiled "
                                "(cache miss) or copied from the compiled (cache hit)", ["cache"],
                                registry=self.registry)
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds",
                                             "From a request's start to its choice's first token",
                                             buckets=TTFT_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(PREFIX + "inter_token_latency_seconds",
                                             "Between a choice's tokens as they arrive", buckets=ITL_BUCKETS,
                                             registry=self.registry)

    def token(self, started: float, last: float | None) -> float:
        """A choice's token arrived now: its latency observed (the first's from `started`, later ones' from the
        `last`); returns now."""
        now = time.perf_counter()
        if last is None:
            self.time_to_first_token.observe(now - started)
        else:
            self.inter_token_latency.observe(now - last)
        self.generation_tokens.inc()
        return now

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
