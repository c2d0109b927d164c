"""Gateway metrics in the Prometheus text format: requests, latency, in-flight, model state.

Written by hand (a few dicts under one lock) so the per-request cost stays in microseconds.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

from relax_launch.inference.manager import InferenceManager

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, str, int], int] = defaultdict(int)
        self.latency: dict[tuple[str, str], list[int]] = {}
        self.latency_sum: dict[tuple[str, str], float] = defaultdict(float)
        self.in_flight: dict[str, int] = defaultdict(int)

    def started(self, role: str) -> None:
        with self._lock:
            self.in_flight[role] += 1

    def finished(self, role: str, endpoint: str, model: str, status: int, seconds: float) -> None:
        with self._lock:
            self.in_flight[role] -= 1
            self.requests[(role, endpoint, model, status)] += 1
            counts = self.latency.setdefault((role, endpoint), [0] * (len(BUCKETS_S) + 1))
            counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
            self.latency_sum[(role, endpoint)] += seconds

    def render(self, managers: dict[str, InferenceManager]) -> str:
        lines = [
            "# TYPE relax_gateway_requests_total counter",
            "# TYPE relax_gateway_request_seconds histogram",
            "# TYPE relax_gateway_in_flight gauge",
            "# TYPE relax_model_ready gauge",
            "# TYPE relax_model_weight_version gauge",
        ]
        with self._lock:
            for (role, endpoint, model, status), n in sorted(self.requests.items()):
                labels = f'role="{role}",endpoint="{endpoint}",model="{model}",status="{status}"'
                lines.append(f"relax_gateway_requests_total{{{labels}}} {n}")
            for (role, endpoint), counts in sorted(self.latency.items()):
                labels = f'role="{role}",endpoint="{endpoint}"'
                total = 0
                for bound, n in zip((*BUCKETS_S, "+Inf"), counts, strict=True):
                    total += n
                    lines.append(
                        f'relax_gateway_request_seconds_bucket{{{labels},le="{bound}"}} {total}'
                    )
                lines.append(f"relax_gateway_request_seconds_count{{{labels}}} {total}")
                sum_s = self.latency_sum[(role, endpoint)]
                lines.append(f"relax_gateway_request_seconds_sum{{{labels}}} {sum_s:.6f}")
            for role, n in sorted(self.in_flight.items()):
                lines.append(f'relax_gateway_in_flight{{role="{role}"}} {n}')
        for role, manager in sorted(managers.items()):
            labels = f'role="{role}",model="{manager.model_id}"'
            lines.append(f"relax_model_ready{{{labels}}} {int(manager.ready)}")
            if manager.weight_version is not None:
                lines.append(f"relax_model_weight_version{{{labels}}} {manager.weight_version}")
        return "\n".join(lines) + "\n"
