"""Prometheus metrics of the service, exported by the router at GET /metrics (Ray Serve's own
metrics stay on Ray's metrics port). Per-shard gauges are refreshed from the shards at each scrape."""
from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
SHARD_GAUGES = {
    "index_size": "live ads in the shard's index",
    "capacity": "slots allocated in the shard's index",
    "lag_seconds": "how long the oldest entry known to be unapplied has waited (0 when caught up; entries the consumer "
                   "cannot read are not known: see stream_read_age_seconds)",
    "stream_up": "0 once the consumer has read nothing of its shard's stream for stream_down_s, each read failing or "
                 "waiting on Redis (the replica stays ready, serving what it applied), else 1",
    "stream_read_age_seconds": "seconds since the consumer last read its shard's stream (a fraction of a second while "
                               "it follows it; entries published since are not applied)",
    "applied": "stream entries that changed the index",
    "stale": "stream entries that were stale no-ops",
    "dead_letters": "poison stream entries the replica met (each recorded once in the dead-letter stream), each "
                    "counted once, whatever it reads again",
    "errors": "errors the consumer recovered from",
    "stream_resets": "times the shard's stream went back behind what the consumer read (a Redis that lost writes took "
                     "over, or the stream was recreated) and was read again from its start",
    "ready": "1 when the replica has caught up with its stream and serves the router's model and schema (as /readyz)",
}


class ServiceMetrics:
    """The router's metrics in a registry of their own (one per router replica)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram("andromeda_request_seconds", "Request latency by endpoint and stage",
                                 ["endpoint", "stage"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.shard_latency = Histogram("andromeda_shard_search_seconds", "One shard's batched pass, seen by the shard",
                                       ["shard"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.eligible = Counter("andromeda_eligible_ads", "Ads eligible for the requests answered", registry=self.registry)
        self.scanned = Counter("andromeda_scanned_slots", "Index slots matched and scored for the requests answered",
                               registry=self.registry)
        self.requests = Counter("andromeda_requests", "Requests answered by endpoint", ["endpoint"], registry=self.registry)
        self.errors = Counter("andromeda_errors", "Requests that failed, by cause", ["cause"], registry=self.registry)
        self.limiter_fallbacks = Counter("andromeda_rate_limit_fallbacks", "Rate-limit decisions made with the "
                                         "router's own bucket because the shared one in Redis did not answer",
                                         registry=self.registry)
        self.published = Counter("andromeda_events_published", "Ad events appended to the streams", registry=self.registry)
        self.shard = {name: Gauge(f"andromeda_shard_{name}", text, ["shard"], registry=self.registry)
                      for name, text in SHARD_GAUGES.items()}

    def stage(self, endpoint: str, stage: str, seconds: float) -> None:
        self.latency.labels(endpoint, stage).observe(seconds)

    def render(self, shard_status: Sequence[dict]) -> bytes:
        """Prometheus text format, with the per-shard gauges set from each shard's status as /readyz shows it (a gauge
        the status lacks is NaN: an unreachable shard's are all but ready, and a shard of an older version, during a
        rollout, may lack a newer one)."""
        for shard, status in enumerate(shard_status):
            for name, gauge in self.shard.items():
                gauge.labels(str(shard)).set(float(status.get(name, float("nan"))))
        return generate_latest(self.registry)
