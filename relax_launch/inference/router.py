"""SGLangRouter: an sglang-router process in front of the rollout engines (route mode ROUTER).

Rank 0 starts it once the engines are up and stops it by PID with the job; it is ready once it
answers a real generation through one of its workers.
"""

from __future__ import annotations

import sys
from pathlib import Path

from relax_launch.inference.process import OwnedProcess
from relax_launch.inference.server import free_port


class SGLangRouter(OwnedProcess):
    def __init__(
        self, *, worker_urls: list[str], log_path: str | Path, host: str = "127.0.0.1"
    ) -> None:
        self.worker_urls = list(worker_urls)
        super().__init__(
            host=host,
            port=free_port(host),
            log_path=log_path,
            what=f"sglang-router for {len(worker_urls)} engines",
        )

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--policy",
            "round_robin",
            "--log-level",
            "warn",
            "--worker-urls",
            *self.worker_urls,
        ]
