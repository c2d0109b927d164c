"""Gateway metrics through prometheus_client: requests, latency, in-flight, model state; and
the controller's own requests (``ControllerMetrics``, counted apart from the gateway's).

Each gateway has a registry of its own (not the process-wide default), so that several gateways
in one process (tests, benchmarks) count apart. Labelled children are looked up once and kept:
``labels()`` on every request would cost as much again.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from relax_launch.inference.discovery import State
from relax_launch.inference.manager import InferenceManager

Metric = Counter | Gauge | Histogram
BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
CONTROLLER_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class ModelStates(Collector):
    """``relax_model_ready`` and ``relax_model_weight_version`` per model of each role, and
    ``relax_engine_requests_answered`` per engine (the gateway's and the controller's requests
    its current server answered), read from the managers when scraped."""

    def __init__(self, managers: dict[str, InferenceManager]) -> None:
        self.managers = managers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["role", "model"]
        ready = GaugeMetricFamily(
            "relax_model_ready", "1 when the model takes requests", None, labels
        )
        version = GaugeMetricFamily(
            "relax_model_weight_version", "The weight version the engines serve", None, labels
        )
        answered = GaugeMetricFamily(
            "relax_engine_requests_answered",
            "Requests the engine's current server answered",
            None,
            ["role", "model", "engine"],
        )
        for role, manager in sorted(self.managers.items()):
            for model_id, record in manager.snapshot().models.items():
                ready.add_metric([role, model_id], int(record.state is State.READY))
            if manager.weight_version is not None:
                version.add_metric([role, manager.model_id], float(manager.weight_version))
            for engine in manager.engines:
                count = manager.requests.answered(engine.engine_id)
                answered.add_metric([role, manager.model_of(engine), engine.engine_id], count)
        yield ready
        yield version
        yield answered


class GatewayMetrics:
    """The gateway's metrics, on a registry of their own."""

    def __init__(self, managers: dict[str, InferenceManager]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "relax_gateway_requests",
            "Requests answered, by role, endpoint, model and status",
            ["role", "endpoint", "model", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "relax_gateway_request_seconds",
            "Time to the end of the reply (of the stream, for streams)",
            ["role", "endpoint"],
            buckets=BUCKETS_S,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "relax_gateway_in_flight", "Requests being answered", ["role"], registry=self.registry
        )
        self.registry.register(ModelStates(managers))
        self._children: dict[tuple, Metric] = {}

    def _child(self, metric: Metric, *labels: str) -> Metric:
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def started(self, role: str) -> None:
        self._child(self.in_flight, role).inc()

    def finished(self, role: str, endpoint: str, model: str, status: int, seconds: float) -> None:
        self._child(self.in_flight, role).dec()
        self._child(self.requests, role, endpoint, model, str(status)).inc()
        self._child(self.latency, role, endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ControllerMetrics:
    """The controller's requests by role, endpoint, model and status, with latency and in-flight
    counts, in a Prometheus registry (its own unless one is given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "relax_controller_requests",
            "Requests the RL controller sent to the engines (not through the gateway).",
            ("role", "endpoint", "model", "status"),
            registry=self.registry,
        )
        self.seconds = Histogram(
            "relax_controller_request_seconds",
            "Latency of the controller's engine requests.",
            ("role", "endpoint"),
            buckets=CONTROLLER_BUCKETS_S,
            registry=self.registry,
        )
        self.engines_lost = Counter(
            "relax_controller_engines_lost",
            "Engines the controller found dead and routed around ({role}.fault_tolerance).",
            ("role",),
            registry=self.registry,
        )
        self.regenerated = Counter(
            "relax_controller_requests_regenerated",
            "Requests lost on an engine that died or was scaled in, sent to another engine.",
            ("role",),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "relax_controller_in_flight",
            "Controller requests in flight.",
            ("role",),
            registry=self.registry,
        )

    def finished(self, role: str, endpoint: str, model: str, status: int, seconds: float) -> None:
        self.requests.labels(role, endpoint, model, str(status)).inc()
        self.seconds.labels(role, endpoint).observe(seconds)
