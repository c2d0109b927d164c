"""SGLangServer: one SGLang HTTP server process, started, checked and stopped by its PID."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from relax_launch import http, platform
from relax_launch.inference import disaggregation
from relax_launch.inference.process import PROBE, OwnedProcess, free_port

# weight sync's receiver, an SGLang plugin of the project (weights/receiver.py): setup.py's
# entry point of group sglang.srt.plugins
RECEIVER_PLUGIN = "relax_launch_weights"


def engine_cli_args(engine: dict[str, Any]) -> list[str]:
    """``{max_total_tokens: 4096, enable_x: true, names: [a, b], over: {k: 1}}`` ->
    ``--max-total-tokens 4096 --enable-x --names a b --over '{"k": 1}'`` (a list is the values
    of a many-valued flag, a mapping one JSON value)."""
    args = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, list | tuple):
            args += [flag, *map(str, value)]
        elif value is not False and value is not None:
            args += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return args


class SGLangServer(OwnedProcess):
    """An SGLang HTTP server for one engine; ready once it has generated one token.

    An engine spanning nodes runs one such process per node (``nnodes``, ``node_rank``, all
    meeting at ``dist_init_addr``); only node rank 0 serves generation, the others answer
    ``/health`` once their TP workers are up, and node 0's first token needs them all."""

    def __init__(
        self,
        *,
        model_path: str | Path,
        device: platform.Device,
        log_path: str | Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        tp_size: int = 1,
        pp_size: int = 1,
        base_gpu_id: int = 0,
        nnodes: int = 1,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
        engine: dict[str, Any] | None = None,
        extra_env: dict[str, str] | None = None,
        disaggregation_half: str | None = None,
    ) -> None:
        self.model_path, self.device = str(model_path), device
        # "prefill" or "decode": one half of a disaggregated engine pair (its own flags, and a
        # bootstrap port where a prefill engine's KV transfers are arranged)
        self.half = disaggregation_half
        self.bootstrap_port = free_port(host) if self.half == "prefill" else None
        self.extra_env = dict(extra_env or {})
        self.parallel = {"tp_size": tp_size, "pp_size": pp_size, "base_gpu_id": base_gpu_id}
        if nnodes > 1:
            self.parallel |= {
                "nnodes": nnodes,
                "node_rank": node_rank,
                "dist_init_addr": dist_init_addr,
            }
        self.nnodes, self.node_rank = nnodes, node_rank
        self.engine = dict(engine or {})
        super().__init__(
            host=host,
            port=port,
            log_path=log_path,
            what=f"SGLang server for {self.model_path}",
        )

    def choose_ports(self) -> None:
        super().choose_ports()
        if self.half == "prefill":
            self.bootstrap_port = free_port(self.host)

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            platform.sglang_server_module(self.device),
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *engine_cli_args(self.parallel),
            *platform.sglang_server_args(self.device),
            *engine_cli_args(self.engine),
            *engine_cli_args(disaggregation.server_args(self.half, self.bootstrap_port)),
            *platform.disaggregation_server_args(self.device, self.half),
        ]

    def probe(self, timeout_s: float) -> None:
        if self.node_rank == 0 and self.half is not None:
            # a half generates alone for a request with SGLang's fake bootstrap address (no KV
            # moves); the pair's own first token is checked once both halves are up
            body = {**PROBE, **disaggregation.ALONE}
            http.call(
                "POST", self.url + "/generate", json=body, timeout_s=timeout_s
            ).raise_for_status()
        elif self.node_rank == 0:
            super().probe(timeout_s)
        else:  # a follower node's process serves /health only, once its TP workers joined
            http.call("GET", self.url + "/health", timeout_s=timeout_s).raise_for_status()

    def env(self, base: dict[str, str]) -> dict[str, str]:
        # Logprobs of the model itself, not of the temperature-scaled sampling distribution: the
        # trainer and the teacher score tokens that way, so PPO ratios and KLs compare like with
        # like at any sampling temperature.
        env = {
            **platform.sglang_env(self.device, base=base),
            "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
            **self.extra_env,
        }
        env |= platform.disaggregation_env(self.device, self.half)
        env |= disaggregation.server_env(self.half)
        if self.nnodes > 1:
            # where this node's TP workers are reached by the other nodes' (SGLang's message
            # queues otherwise guess it from the hostname or a route to a public DNS server)
            env["SGLANG_HOST_IP"] = self.host
        # a whitelist of plugins in the environment keeps weight sync's receiver (a list given
        # to this server itself is taken as it is)
        if env.get("SGLANG_PLUGINS") and "SGLANG_PLUGINS" not in self.extra_env:
            env["SGLANG_PLUGINS"] += "," + RECEIVER_PLUGIN
        return env
