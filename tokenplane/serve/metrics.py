"""Prometheus metrics of one server (`GET /metrics`), on a registry of its own (several apps per process in tests).

Counters and histograms are updated by the request path; gauges that describe state (KV blocks, queue, models,
sessions, verifier) are read from their owners at scrape time by a collector, so they are never stale.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _StateCollector(Collector):
    def __init__(self, health: Callable[[], Any], sessions: Callable[[], Any] | None) -> None:
        self.health, self.sessions = health, sessions

    def collect(self) -> Iterator[Any]:
        h = self.health()
        up = GaugeMetricFamily("tokenplane_model_up", "1 when the model's process is ready", labels=["model"])
        used = GaugeMetricFamily("tokenplane_kv_blocks_used", "KV cache blocks in use", labels=["model"])
        total = GaugeMetricFamily("tokenplane_kv_blocks_total", "KV cache blocks in the pool", labels=["model"])
        restarts = GaugeMetricFamily("tokenplane_model_restarts", "restarts of the model's process", labels=["model"])
        for m in h.models:
            up.add_metric([m.name], 1.0 if m.state == "ready" else 0.0)
            restarts.add_metric([m.name], float(m.restarts))
            if m.kv_blocks_used is not None:
                used.add_metric([m.name], float(m.kv_blocks_used))
            if m.kv_blocks_total is not None:
                total.add_metric([m.name], float(m.kv_blocks_total))
        yield from (up, used, total, restarts)
        yield GaugeMetricFamily("tokenplane_requests_live", "requests admitted and not finished",
                                value=float(h.live_requests))
        yield GaugeMetricFamily("tokenplane_requests_queued", "requests waiting for a batch slot",
                                value=float(h.queued_requests))
        if self.sessions is None:
            return
        s = self.sessions()
        yield GaugeMetricFamily("tokenplane_sessions", "live tokenization sessions", value=float(s["sessions"]))
        yield GaugeMetricFamily("tokenplane_session_bytes", "bytes held by tokenization sessions",
                                value=float(s["bytes"]))
        yield CounterMetricFamily("tokenplane_sessions_evicted", "sessions evicted (TTL, count cap or byte budget)",
                                  value=float(s["evicted"]))
        samples = CounterMetricFamily("tokenplane_verifier_samples", "shadow-verifier re-encodes", labels=["model"])
        bad = CounterMetricFamily("tokenplane_verifier_mismatches", "shadow-verifier mismatches", labels=["model"])
        for name, v in s.get("verifier", {}).items():
            samples.add_metric([name], float(v.get("checked", 0)))
            bad.add_metric([name], float(v.get("mismatches", 0)))
        yield samples
        yield bad


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tokenplane_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.latency = Histogram("tokenplane_request_latency_seconds", "end-to-end request latency", ["route"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tokenplane_time_to_first_token_seconds", "time to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tokenplane_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("tokenplane_generation_tokens", "generated tokens", registry=r)
        self.routed_tokens = Counter("tokenplane_routed_tokens", "generated tokens by producing model", ["model"],
                                     registry=r)
        self.handoffs = Counter("tokenplane_routing_handoffs", "model switches inside requests", registry=r)
        self.routing_rate = Histogram("tokenplane_routing_rate", "share of a request's tokens off its home model",
                                      buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0), registry=r)
        self.errors = Counter("tokenplane_request_errors", "failed generation requests by kind", ["kind"], registry=r)

    def watch(self, health: Callable[[], Any], sessions: Callable[[], Any] | None) -> None:
        self.registry.register(_StateCollector(health, sessions))

    def record_routing(self, stats: dict[str, Any] | None) -> None:
        if not stats:
            return
        per_model = stats.get("tokens_per_model")
        if isinstance(per_model, (list, tuple)):
            for m, n in enumerate(per_model):
                if n:
                    self.routed_tokens.labels(str(m)).inc(float(n))
        handoffs = stats.get("num_handoffs", stats.get("handoffs"))
        if isinstance(handoffs, (int, float)) and handoffs > 0:
            self.handoffs.inc(float(handoffs))
        rate = stats.get("routing_rate")
        if isinstance(rate, (int, float)):
            self.routing_rate.observe(float(rate))

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "Metrics"]
