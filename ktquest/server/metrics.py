"""What ``ktquest serve`` tells its operator: a line per request on the ``ktquest.serve`` logger, and ``/metrics``
in Prometheus' text format (prometheus-client, one registry per app).

The line: ``<id> <endpoint> <status> prompt=<tokens> cached=<reused> new=<generated> ttft=<s> <tok/s> tok/s
<finish>`` for an answer, ``<endpoint> <status> <error message>`` for a refused request.

The metrics: requests by endpoint and status, prompt / cached / prefilled / completion tokens, the time to first
token and the decode speed as histograms, and the requests running or waiting and the slots' tokens as gauges
(read when /metrics is asked).
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ktquest.server.worker import Result

log = logging.getLogger("ktquest.serve")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ktquest_requests", "requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.tokens = Counter("ktquest_tokens", "tokens of the answered requests: prompt (all of it), cached "
                              "(reused from a slot), completion (generated)", ["kind"], registry=r)
        self.ttft = Histogram("ktquest_time_to_first_token_seconds", "from a request taken up to its first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300), registry=r)
        self.decode = Histogram("ktquest_decode_tokens_per_second", "a request's steady decode speed",
                                buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500), registry=r)
        self.running = Gauge("ktquest_requests_running_or_waiting", "requests inside the server", registry=r)
        self.slot_tokens = Gauge("ktquest_slot_tokens", "tokens each slot's cache holds", ["slot"], registry=r)

    def answered(self, rid: str, endpoint: str, result: Result) -> None:
        """A request that got its answer (complete, or streamed to its end)."""
        self.requests.labels(endpoint, "200").inc()
        for kind, n in (("prompt", result.prompt_tokens), ("cached", result.cached_tokens),
                        ("completion", result.completion_tokens)):
            self.tokens.labels(kind).inc(n)
        speed = result.decode_tok_s
        if result.completion_tokens:
            self.ttft.observe(result.ttft_s)
        if speed:
            self.decode.observe(speed)
        log.info("%s %s 200 prompt=%d cached=%d new=%d ttft=%.2fs %.1f tok/s %s", rid, endpoint, result.prompt_tokens,
                 result.cached_tokens, result.completion_tokens, result.ttft_s, speed, result.finish_reason)

    def refused(self, endpoint: str, status: int, message: str) -> None:
        """A request answered with an error."""
        self.requests.labels(endpoint, str(status)).inc()
        log.info("%s %d %s", endpoint, status, message)

    def render(self, running: int, slots: list[int]) -> bytes:
        self.running.set(running)
        for i, n in enumerate(slots):
            self.slot_tokens.labels(str(i)).set(n)
        return generate_latest(self.registry)
