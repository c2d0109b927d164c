"""GatewayServer: runs the gateway's ASGI app under uvicorn on a daemon thread of rank 0."""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from relax_launch.deadline import Deadline
from relax_launch.inference.gateway import InferenceGateway


class GatewayServer:
    """Binds (port 0 = a free port), serves until ``stop``; start and stop are bounded."""

    def __init__(self, app: InferenceGateway, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            interface="asgi3",
            loop="uvloop",
            http="httptools",
            timeout_keep_alive=30,
            proxy_headers=False,  # rank 0 binds loopback by default; no proxy in front
            server_header=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="relax-gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        # uvicorn binds itself: its accepted connections then get TCP_NODELAY, which a socket
        # handed in does not (and replies would wait 40 ms on delayed ACKs).
        self.server.run()  # on the uvloop event loop; signal handlers stay with the main thread

    def start(self, timeout_s: float = 30.0) -> None:
        self.thread.start()
        deadline = Deadline(timeout_s)
        while not self.server.started:
            if not self.thread.is_alive() or deadline.passed:
                raise RuntimeError(f"the gateway did not start on {self.url} within {timeout_s} s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        logging.getLogger("relax_launch.gateway").info("gateway serving on %s", self.url)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(timeout_s)
