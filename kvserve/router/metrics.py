"""The router's Prometheus metrics, on a registry of its own (``GET /metrics``).

Labelled by replica and policy only, never by tenant, prompt or block: what one tenant sends
cannot show through them to another (nor through the router's responses, which are the
replicas' own, or its errors, which name replicas, not prefixes). The process's own
``process_*`` families come too, as on a server: its CPU seconds over its decisions are
what one router process spends per request, which says how many processes a load needs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

PREFIX = "kvserve:router_"


class RouterMetrics:
    def __init__(self, replicas: list[str]) -> None:
        self.registry = r = CollectorRegistry()
        self.decisions = Counter(PREFIX + "decisions", "Routing decisions, by policy, replica "
                                 "and whether the imbalance guard overrode the cache score.",
                                 ["policy", "replica", "balanced"], registry=r)  # fmt: skip
        self.decision_seconds = Histogram(
            PREFIX + "decision_seconds", "Time to choose a replica (tokenizing excluded).",
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2), registry=r,
        )  # fmt: skip
        self.expected_hit = Counter(PREFIX + "expected_hit_tokens", "Prompt tokens the "
                                    "policy expected the chosen replica to hold.",
                                    ["replica"], registry=r)  # fmt: skip
        self.reported_hit = Counter(PREFIX + "reported_hit_tokens", "Prompt tokens the replica "
                                    "reported cached (usage.prompt_tokens_details).",
                                    ["replica"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens the replicas "
                                     "reported (usage.prompt_tokens).", ["replica"],
                                     registry=r)  # fmt: skip
        self.in_flight = Gauge(PREFIX + "requests_in_flight", "Requests the router has sent "
                               "to a replica and not seen finish.", ["replica"],
                               registry=r)  # fmt: skip
        self.blocks_in_flight = Gauge(PREFIX + "blocks_in_flight", "Prompt blocks of those "
                                      "requests (the cost's load term).", ["replica"],
                                      registry=r)  # fmt: skip
        self.healthy = Gauge(PREFIX + "replica_healthy", "1 while the replica's health check "
                             "passes.", ["replica"], registry=r)  # fmt: skip
        self.index_blocks = Gauge(PREFIX + "index_blocks", "Blocks the event index holds for "
                                  "the replica (any medium).", ["replica"],
                                  registry=r)  # fmt: skip
        self.failovers = Counter(PREFIX + "failovers", "Requests sent elsewhere because the "
                                 "chosen replica could not take them.", ["replica"],
                                 registry=r)  # fmt: skip
        self.failed = Counter(PREFIX + "failed_requests", "Requests that failed after their "
                              "replica started them (a clear error to the client).",
                              ["replica"], registry=r)  # fmt: skip
        ProcessCollector(registry=r)
        for name in replicas:
            self.healthy.labels(name).set(1)
            self.in_flight.labels(name).set(0)
