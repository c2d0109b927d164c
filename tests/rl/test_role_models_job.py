"""Several models behind one role, in a real job: two teacher models, each scoring the samples
of its data source, and two judge models, each judging its reward source (tiny Llamas, CPU).
While the job runs, the gateway lists both models of each role, routes by ``model`` and
``route_key`` and answers an unknown model 400; once it ends, the counts per engine show every
request reached the engine of the model it was meant for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from harness.prometheus_text import total

from relax_launch.deadline import Deadline

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CONFIG = Path(__file__).parent / "role_models_tiny.yaml"
STEPS, PROMPTS_PER_SOURCE, SAMPLES = 3, 2, 2  # every step draws the four prompts
ROWS = [
    {"prompt": "What is 2 + 3?", "label": "5", "data_source": "alpha"},
    {"prompt": "What is 4 + 4?", "label": "8", "data_source": "beta"},
    {"prompt": "What is 1 + 6?", "label": "7", "data_source": "alpha"},
    {"prompt": "What is 9 + 2?", "label": "11", "data_source": "beta"},
]


def wait_for(what: str, check, job: subprocess.Popen, timeout_s: float = 600.0):
    deadline = Deadline(timeout_s)
    while not deadline.passed:
        assert job.poll() is None, f"the job ended (exit {job.returncode}) before {what}"
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")


def gateway_of(run_dir: Path) -> str | None:
    record = run_dir / "gateway.json"
    return json.loads(record.read_text())["url"] if record.exists() else None


def ready(gateway: str, role: str) -> bool:
    return httpx.get(f"{gateway}/{role}/health", timeout=10).json()["ready"]


def check_the_gateway(gateway: str) -> None:
    """Discovery lists both models of each role, each on its own engine; requests choose a
    model by id or route_key; an unknown model is a 400 naming the known ones."""
    for role, default, other in (
        ("teacher", "teacher-alpha", "teacher-beta"),
        ("genrm", "judge-style", "judge-facts"),
    ):
        models = [default, other]
        found = httpx.get(f"{gateway}/{role}/engines", timeout=10).json()
        assert sorted(found["models"]) == sorted(models)
        assert found["routing"]["default_model"] == default
        urls = {m: [e["base_url"] for e in r["engines"]] for m, r in found["models"].items()}
        assert all(len(u) == 1 for u in urls.values()) and len({u[0] for u in urls.values()}) == 2
        assert all(r["state"] == "READY" for r in found["models"].values())
        listed = httpx.get(f"{gateway}/{role}/v1/models", timeout=10).json()["data"]
        assert set(models) <= {m["id"] for m in listed}
    score = {"input_ids": [1, 5, 9, 12], "sampling_params": {"max_new_tokens": 1}}
    for choice in ({"model": "teacher-beta"}, {"route_key": "alpha"}):
        reply = httpx.post(f"{gateway}/teacher/generate", json={**score, **choice}, timeout=60)
        assert reply.status_code == 200, reply.text
    unknown = httpx.post(f"{gateway}/teacher/generate", json={**score, "model": "teacher-x"})
    assert unknown.status_code == 400
    message = unknown.json()["error"]["message"]
    assert "teacher-x" in message and "teacher-alpha" in message and "teacher-beta" in message
    judged = {"model": "judge-facts", "messages": [{"role": "user", "content": "2+2=4?"}]}
    judged["sampling_params"] = {"max_new_tokens": 2}
    reply = httpx.post(f"{gateway}/genrm/generate", json=judged, timeout=60)
    assert reply.status_code == 200 and "response" in reply.json(), reply.text


def test_teachers_by_data_source_and_judges_by_reward_source(tmp_path):
    dataset, run_dir = tmp_path / "two_sources.jsonl", tmp_path / "run"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    cli = Path(sys.executable).with_name("relax-launch")
    overrides = [f"data.dataset={dataset}", f"logging.dir={run_dir}", "logging.level=warning"]
    overrides.append(f"algorithm.num_steps={STEPS}")
    began = time.perf_counter()
    job = subprocess.Popen(
        [str(cli), "run", str(CONFIG), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
    )
    try:
        gateway = wait_for("gateway.json", lambda: gateway_of(run_dir), job)
        wait_for(
            "both roles ready", lambda: ready(gateway, "teacher") and ready(gateway, "genrm"), job
        )
        check_the_gateway(gateway)
        console = job.communicate(timeout=900)[0]
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    print(f"\nrole-models job: {time.perf_counter() - began:.1f} s")
    assert job.returncode == 0, console[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["reward/style/failed"] == 0 and s["reward/facts/failed"] == 0 for s in steps)
    counted = (run_dir / "gateway_metrics.txt").read_text()
    per_source = STEPS * PROMPTS_PER_SOURCE * SAMPLES  # each teacher: its source's samples
    per_judge = 2 * per_source  # each judge: every sample, for its reward source
    expected = {
        ("teacher", "teacher-alpha"): per_source,
        ("teacher", "teacher-beta"): per_source,
        ("genrm", "judge-style"): per_judge,
        ("genrm", "judge-facts"): per_judge,
    }
    for (role, model), count in expected.items():
        sent = {"role": role, "model": model, "status": "200"}
        assert total(counted, "relax_controller_requests_total", **sent) == count, counted
    # per engine (each model has one): the controller's requests and the test's own, above
    engines = {
        "teacher-alpha/0": per_source + 1,  # + route_key alpha
        "teacher-beta/1": per_source + 1,  # + model teacher-beta
        "judge-style/0": per_judge,
        "judge-facts/1": per_judge + 1,  # + the judge form naming judge-facts
    }
    for engine, count in engines.items():
        answered = total(counted, "relax_engine_requests_answered", engine=engine)
        assert answered == count, (engine, counted)
