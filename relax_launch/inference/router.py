"""SGLangRouter: an sglang-router process in front of the rollout engines (route mode ROUTER).

Rank 0 starts it once the engines are up and stops it by PID with the job. It routes by
``gateway.routing_policy``: ``round_robin`` with the router's own ``round_robin``; ``affinity``
with its ``manual`` policy, which pins each ``x-smg-routing-key`` to one worker (a new key goes to
the worker with the fewest keys in flight, ties at random) until the key idles for the router's
``max_idle_secs`` (4 h) or its worker fails the router's health checks. The gateway sends the key
to the router only under ``affinity``.

The router answers generations as soon as one worker has registered, and a key pinned then stays
on that worker for hours: it is ready only once it lists every worker as healthy and answers a
real generation.
"""

from __future__ import annotations

import sys
from pathlib import Path

from relax_launch import http
from relax_launch.inference.config import RoutingPolicy
from relax_launch.inference.process import OwnedProcess, free_port

ROUTER_POLICY_ARGS: dict[str, tuple[str, ...]] = {
    "round_robin": ("--policy", "round_robin"),
    "affinity": ("--policy", "manual", "--assignment-mode", "min_group"),
}


class SGLangRouter(OwnedProcess):
    def __init__(
        self,
        *,
        worker_urls: list[str],
        log_path: str | Path,
        policy: RoutingPolicy,
        host: str = "127.0.0.1",
        prefill: list[tuple[str, int]] | None = None,
        decode_urls: list[str] | None = None,
    ) -> None:
        """``prefill`` ((URL, bootstrap port) each) and ``decode_urls``: the halves of a
        disaggregated role, routed in the router's prefill/decode mode (no ``worker_urls``)."""
        self.worker_urls, self.policy = list(worker_urls), policy
        self.prefill, self.decode_urls = list(prefill or []), list(decode_urls or [])
        engines = len(self.worker_urls) + len(self.prefill) + len(self.decode_urls)
        # its metrics listener has a fixed default port: two jobs on one host would collide
        self.prometheus_port = free_port(host)
        super().__init__(
            host=host,
            port=None,
            log_path=log_path,
            what=f"sglang-router ({policy}) for {engines} engines",
        )

    def choose_ports(self) -> None:
        super().choose_ports()
        self.prometheus_port = free_port(self.host)

    def probe(self, timeout_s: float) -> None:
        """Raises until the router lists every worker as healthy and generates a token."""
        listed = http.call("GET", self.url + "/workers", timeout_s=timeout_s)
        healthy = {w["url"] for w in listed.raise_for_status().json()["workers"] if w["is_healthy"]}
        expected = {*self.worker_urls, *(url for url, _ in self.prefill), *self.decode_urls}
        missing = expected - healthy
        if missing:
            raise http.TransportError(f"workers not yet registered and healthy: {sorted(missing)}")
        super().probe(timeout_s)

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *ROUTER_POLICY_ARGS[self.policy],
            "--log-level",
            "warn",
            "--prometheus-host",
            self.host,
            "--prometheus-port",
            str(self.prometheus_port),
            *self.workers_args(),
        ]

    def workers_args(self) -> list[str]:
        if not self.prefill:
            return ["--worker-urls", *self.worker_urls]
        args = ["--pd-disaggregation"]
        for url, bootstrap_port in self.prefill:
            args += ["--prefill", url, str(bootstrap_port)]
        for url in self.decode_urls:
            args += ["--decode", url]
        return args
