"""SGLangServer: one SGLang HTTP server process, started, checked and stopped by its PID."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

from relax_launch import platform
from relax_launch.inference.process import OwnedProcess

RECEIVER_PLUGIN = "relax_launch_weights"  # setup.py's sglang.srt.plugins entry point


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def engine_cli_args(engine: dict[str, Any]) -> list[str]:
    """``{max_total_tokens: 4096, enable_x: true}`` -> ``--max-total-tokens 4096 --enable-x``."""
    args = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False and value is not None:
            args += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return args


class SGLangServer(OwnedProcess):
    """An SGLang HTTP server for one engine; ready once it has generated one token."""

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
        engine: dict[str, Any] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.model_path, self.device = str(model_path), device
        self.extra_env = dict(extra_env or {})
        self.parallel = {"tp_size": tp_size, "pp_size": pp_size, "base_gpu_id": base_gpu_id}
        self.engine = dict(engine or {})
        super().__init__(
            host=host,
            port=port or free_port(host),
            log_path=log_path,
            what=f"SGLang server for {self.model_path}",
        )

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *engine_cli_args(self.parallel),
            *platform.sglang_server_args(self.device),
            *engine_cli_args(self.engine),
        ]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        # Logprobs of the model itself, not of the temperature-scaled sampling distribution: the
        # trainer and the teacher score tokens that way, so PPO ratios and KLs compare like with
        # like at any sampling temperature.
        env = {
            **platform.sglang_env(self.device, base=base),
            "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
            **self.extra_env,
        }
        if env.get("SGLANG_PLUGINS"):  # a whitelist of plugins must keep weight sync's receiver
            env["SGLANG_PLUGINS"] += "," + RECEIVER_PLUGIN
        return env
