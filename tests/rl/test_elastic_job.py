"""Elastic judge replicas in a real job: an RL job whose reward is the GenRM judge, with a rank
reserved for a second judge engine (``genrm.max_engines: 2``), driven from outside through its
gateway while it trains.

Under a burst of judge requests the autoscaler scales genrm 1 -> 2 on its load (the new engine
answers judge requests once routable), and the API scales it back to 1 with requests in flight
(every request sent is answered, none lost). Each
error of the scale routes is asked for (401, 422, 400, 404, 409). The job is stopped at the end:
it exits as stopped and leaves no process (the scaled-out server is stopped by its PID).

And an autoscaled rollout role (slow): the first rollout phase asks for a second engine, which
is routed after a later weight sync, and the job keeps both across the steps that follow.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness.processes import TEST_TAG, processes_tagged

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
TOKEN = "elastic-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
STOPPED = 75
JUDGE = {
    "messages": [{"role": "user", "content": "Is 2 + 3 = 5? Answer with a score."}],
    "sampling_params": {"max_new_tokens": 320, "ignore_eos": True},
}


class Burst:
    """``workers`` threads sending judge requests to the gateway until ``stop``; counts what
    was sent and what was answered (200), and keeps every other reply."""

    def __init__(self, gateway: str, workers: int) -> None:
        self.gateway, self.sent, self.answered = gateway, 0, 0
        self.failures: list[str] = []
        self._lock, self._stop = threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=self._send, daemon=True) for _ in range(workers)]
        for thread in self.threads:
            thread.start()

    def _send(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                with self._lock:
                    self.sent += 1
                try:
                    reply = client.post(f"{self.gateway}/genrm/generate", json=JUDGE)
                    ok = reply.status_code == 200 and "response" in reply.json()
                    why = f"{reply.status_code} {reply.text[:300]}"
                except httpx.HTTPError as exc:
                    ok, why = False, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if ok:
                        self.answered += 1
                    else:
                        self.failures.append(why)

    def stop(self) -> None:
        self._stop.set()
        for thread in self.threads:
            thread.join(timeout=150)


def scale(gateway: str, kind: str, body: object, auth: dict | None = AUTH) -> httpx.Response:
    return httpx.post(f"{gateway}/genrm/{kind}", json=body, headers=auth or {}, timeout=30)


def wait_for(what: str, check, timeout_s: float = 300.0, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def finished(gateway: str, kind: str, request_id: str) -> dict:
    """The operation's document once it has ended."""

    def ended() -> dict | None:
        doc = httpx.get(f"{gateway}/genrm/{kind}/{request_id}", headers=AUTH, timeout=10).json()
        return doc if doc["state"] not in ("running", "cancelling") else None

    return wait_for(f"{kind} {request_id}", ended)


def replicas(gateway: str) -> list[dict]:
    return httpx.get(f"{gateway}/genrm/admin/engines", headers=AUTH, timeout=10).json()["replicas"]


def routable(gateway: str) -> list[str]:
    discovery = httpx.get(f"{gateway}/genrm/engines", timeout=10).json()
    return [e["engine_id"] for m in discovery["models"].values() for e in m["engines"]]


def start_elastic_job(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """``relax-launch run elastic_tiny.yaml`` with the admin token: (job, run dir, console)."""
    run_dir, console = tmp_path / "run", tmp_path / "console.txt"
    cli = Path(sys.executable).with_name("relax-launch")
    env = {**os.environ, "RELAX_ADMIN_TOKEN": TOKEN}
    with open(console, "w") as out:
        job = subprocess.Popen(
            [str(cli), "run", str(HERE / "elastic_tiny.yaml"), f"logging.dir={run_dir}"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    return job, run_dir, console


def serving_gateway(job: subprocess.Popen, run_dir: Path, console: Path) -> str:
    """The job's gateway URL, once its roles are ready."""
    gateway = wait_for("gateway.json", lambda: _gateway(run_dir, job, console))
    wait_for("the job's roles ready", lambda: _ready(gateway, job, console), 400)
    return gateway


def test_genrm_scales_out_by_the_autoscaler_and_in_by_the_api(tmp_path):
    job, run_dir, console = start_elastic_job(tmp_path)
    burst = None
    try:
        gateway = serving_gateway(job, run_dir, console)
        assert [r["state"] for r in replicas(gateway)] == ["serving", "reserved"]

        # every refusal, before anything changed
        assert scale(gateway, "scale_out", {"num_replicas": 2}, auth=None).status_code == 401
        for wrong in ({"num_replicas": "2"}, {"num_replicas": 2.0}, {"num_replicas": 2, "x": 1}):
            assert scale(gateway, "scale_out", wrong).status_code == 422, wrong
        for outside in (
            {"num_replicas": 3},
            {"num_replicas": 0},
            {"num_replicas": 2, "model": "nope"},
        ):
            reply = scale(gateway, "scale_out", outside)
            assert reply.status_code == 400 and reply.json()["error"]["message"], outside
        assert scale(gateway, "scale_in", {"num_replicas": 1}).status_code == 409  # has 1
        missing = httpx.get(f"{gateway}/genrm/scale_out/0123456789abcdef", headers=AUTH)
        assert missing.status_code == 404

        # a burst: the autoscaler scales out on its load; while that runs, the same target and
        # any other operation are 409
        burst = Burst(gateway, workers=8)
        log = run_dir / "autoscaler.jsonl"
        decision = wait_for("the autoscaler's scale-out", lambda: _decisions(log), 300)[0]
        assert decision["decision"] == "scale_out" and (decision["from"], decision["to"]) == (1, 2)
        assert decision["load"]["in_flight"] >= 5, decision
        again = scale(gateway, "scale_out", {"num_replicas": 2})
        assert again.status_code == 409 and "the same target" in again.json()["error"]["message"]
        assert scale(gateway, "scale_in", {"num_replicas": 1}).status_code == 409
        view = top_once(run_dir)  # the operation in flight, as the operator sees it
        assert "genrm scale_out 1 -> 2 (autoscaler" in view, view
        assert "step " in view and "reward" in view and "rollout" in view, view
        done = finished(gateway, "scale_out", decision["request_id"])
        assert done["state"] == "succeeded" and done["source"] == "autoscaler", done
        assert done["actual"] == 2 and [r["state"] for r in done["replicas"]] == ["serving"], done
        assert sorted(routable(gateway)) == ["tiny-llama/0", "tiny-llama/1"]
        wait_for("the new engine's answers", lambda: replicas(gateway)[1]["answered"] >= 5, 120)

        # 2 -> 1 by the API with requests in flight, drained for 0.05 s only: what is left is
        # sent to the other engine when the server stops, none is lost (a graceful drain:
        # test_scaling.py). The autoscaler's cooldown keeps it from scaling out again.
        on_new = lambda: replicas(gateway)[1]["in_flight"] > 2  # noqa: E731
        wait_for("requests on the new engine", on_new, 60, 0.05)
        reply = scale(gateway, "scale_in", {"num_replicas": 1, "timeout_secs": 0.05})
        assert reply.status_code == 202, reply.text
        done = finished(gateway, "scale_in", reply.json()["request_id"])
        assert done["state"] == "succeeded" and done["actual"] == 1, done
        assert done["replicas"][0]["state"] == "stopped", done
        assert done["replicas"][0]["rerouted"] >= 1, done
        assert routable(gateway) == ["tiny-llama/0"]
        # RFC #351's list and cancel routes: each kind's operations, newest first; a cancel of
        # one that ended is 409, of an unknown id 404 (a cancel in flight: the slow test below)
        for kind, source in (("scale_out", "autoscaler"), ("scale_in", "api")):
            listed = httpx.get(f"{gateway}/genrm/{kind}", headers=AUTH, timeout=10).json()
            assert [o["source"] for o in listed["operations"]] == [source], listed
        out_id = decision["request_id"]
        assert scale(gateway, f"scale_out/{out_id}/cancel", None).status_code == 409
        assert scale(gateway, "scale_out/0123456789abcdef/cancel", None).status_code == 404
        live = watch_top(gateway, seconds=4)  # relax-launch top in a pseudo-terminal
        assert "tiny-llama/0" in live and "serving" in live and "reserved" in live, live
        burst.stop()
        assert burst.failures == [], burst.failures[:5]
        assert burst.answered == burst.sent > 0
        print(f"\njudge requests sent and answered: {burst.sent}")
    finally:
        if burst is not None:
            burst.stop()
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=120)
    text = console.read_text()
    assert code == STOPPED, text[-4000:]
    assert not processes_tagged(os.environ[TEST_TAG])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(row.get("genrm/engines") == 2 for row in metrics), metrics[-1]
    operations = (run_dir / "scaling.jsonl").read_text().splitlines()
    assert [json.loads(line)["operation"] for line in operations] == ["scale_out", "scale_in"]


@pytest.mark.slow  # one more engine start; the default test above asks the other statuses
def test_a_scale_out_cancelled_while_its_engine_starts_leaves_the_count(tmp_path):
    """RFC #351's cancel, for real: the scale-out's 202 answers ``actual`` 1 (the engine
    serving), the cancel 202 ``cancelling``; the start ends, its server is stopped by PID, and
    the role keeps its one engine; the operation is listed as ``cancelled``."""
    job, run_dir, console = start_elastic_job(tmp_path)
    try:
        gateway = serving_gateway(job, run_dir, console)
        servers = len(processes_tagged(os.environ[TEST_TAG]))
        reply = scale(gateway, "scale_out", {"num_replicas": 2})
        assert reply.status_code == 202 and reply.json()["actual"] == 1, reply.text
        request_id = reply.json()["request_id"]
        cancel = scale(gateway, f"scale_out/{request_id}/cancel", None)
        assert cancel.status_code == 202 and cancel.json()["state"] == "cancelling", cancel.text
        assert cancel.headers["location"] == f"/genrm/scale_out/{request_id}"
        done = finished(gateway, "scale_out", request_id)
        assert done["state"] == "cancelled" and done["actual"] == 1, done
        assert [r["state"] for r in done["replicas"]] == ["stopped"], done
        assert routable(gateway) == ["tiny-llama/0"]
        assert [r["state"] for r in replicas(gateway)] == ["serving", "reserved"]
        listed = httpx.get(f"{gateway}/genrm/scale_out", headers=AUTH, timeout=10).json()
        assert [o["state"] for o in listed["operations"]] == ["cancelled"]
        assert scale(gateway, f"scale_out/{request_id}/cancel", None).status_code == 409
        # the started server is gone (stopped by its PID), nothing else of the job is
        alive = lambda: len(processes_tagged(os.environ[TEST_TAG])) <= servers  # noqa: E731
        wait_for("the cancelled engine's processes gone", alive, 60)
    finally:
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=120)
    assert code == STOPPED, console.read_text()[-4000:]
    assert not processes_tagged(os.environ[TEST_TAG])


def top_once(run_dir: Path) -> str:
    """``relax-launch top RUN_DIR --once``, as printed to a wide terminal."""
    env = {**os.environ, "RELAX_ADMIN_TOKEN": TOKEN, "COLUMNS": "200"}
    cli = Path(sys.executable).with_name("relax-launch")
    done = subprocess.run(
        [str(cli), "top", str(run_dir), "--once"], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def watch_top(gateway: str, seconds: float) -> str:
    """The live view (``relax-launch top URL``) in a pseudo-terminal for ``seconds``, then
    Ctrl-C: what it drew, escape codes removed."""
    leader, follower = pty.openpty()
    env = {**os.environ, "RELAX_ADMIN_TOKEN": TOKEN, "COLUMNS": "200", "LINES": "50"}
    cli = Path(sys.executable).with_name("relax-launch")
    view = subprocess.Popen(
        [str(cli), "top", gateway, "--interval", "0.5"], stdin=follower, stdout=follower,
        stderr=follower, env=env, start_new_session=True,
    )  # fmt: skip
    os.close(follower)
    # ``seconds`` of frames, counted from the first (a loaded machine takes seconds to import)
    drawn, first, deadline = b"", None, time.monotonic() + 60
    while time.monotonic() < (deadline if first is None else min(deadline, first + seconds)):
        if select.select([leader], [], [], 0.2)[0]:
            drawn += os.read(leader, 65536)
            if first is None and b"\x1b[" in drawn:
                first = time.monotonic()
    os.killpg(view.pid, signal.SIGINT)
    assert view.wait(timeout=30) == 0
    os.close(leader)
    assert b"\x1b[" in drawn  # a terminal's live view, redrawn in place
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn.decode(errors="replace"))


def _gateway(run_dir: Path, job: subprocess.Popen, console: Path) -> str | None:
    assert job.poll() is None, console.read_text()[-4000:]
    record = run_dir / "gateway.json"
    return json.loads(record.read_text())["url"] if record.is_file() else None


def _ready(gateway: str, job: subprocess.Popen, console: Path) -> bool:
    assert job.poll() is None, console.read_text()[-4000:]
    return httpx.get(f"{gateway}/ready", timeout=10).status_code == 200


def _decisions(log: Path) -> list[dict] | None:
    if not log.is_file():
        return None
    return [json.loads(line) for line in log.read_text().splitlines()] or None


@pytest.mark.slow
def test_an_autoscaled_rollout_role_keeps_its_engines_across_steps(tmp_path):
    run_dir, console = tmp_path / "run", tmp_path / "console.txt"
    cli = Path(sys.executable).with_name("relax-launch")
    env = {**os.environ, "RELAX_ADMIN_TOKEN": TOKEN, "PYTHONPATH": str(HERE)}  # the reward
    config = HERE / "elastic_rollout_tiny.yaml"
    with open(console, "w") as out:
        command = [str(cli), "run", str(config), f"logging.dir={run_dir}"]
        job = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        gateway = wait_for("gateway.json", lambda: _gateway(run_dir, job, console))
        scaled = wait_for("the scale-out", lambda: _ended_operations(run_dir, job, console), 400)
        routed_at = len(_metrics(run_dir))
        wait_for("8 steps with two engines", lambda: len(_metrics(run_dir)) >= routed_at + 8, 120)
        served = httpx.get(f"{gateway}/rollout/admin/engines", headers=AUTH, timeout=10).json()
    finally:
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=120)
    assert code == STOPPED, console.read_text()[-4000:]
    assert not processes_tagged(os.environ[TEST_TAG])
    # one decision, from the first phase's 4 requests at 2 per engine
    [decision] = _decisions(run_dir / "autoscaler.jsonl")
    assert decision["decision"] == "scale_out" and (decision["from"], decision["to"]) == (1, 2)
    assert decision["policy"] == "rollout_phase" and decision["phases"][0]["requests"] == 4
    assert [op["operation"] for op in scaled] == ["scale_out"], scaled
    assert scaled[0]["state"] == "succeeded" and scaled[0]["source"] == "autoscaler", scaled
    assert scaled[0]["request_id"] == decision["request_id"]
    # never scaled in between the steps; the new engine routed at a later sync, then generating
    assert len(_decisions(run_dir / "scaling.jsonl")) == 1
    rows = _metrics(run_dir)
    waited = [r for r in rows if r["rollout/engines_serving"] == 1 and r["step"] > 1]
    assert waited, "no phase ended while the engine started: the no-second-request case"
    assert all(r["rollout/engines_serving"] == 2 for r in rows[routed_at:]), rows[routed_at:]
    assert rows[-1]["rollout/autoscale_decisions"] == 1 and rows[-1]["rollout/engines"] == 2
    assert all(r["answered"] > 0 for r in served["replicas"]), served
    print(
        f"\nrollout 1 -> 2 engines asked after step 1's rollout phase; {len(waited)} steps ran "
        f"while the engine started ({scaled[0]['seconds']:.1f} s), none asked again; two "
        f"engines kept for the {len(rows) - routed_at} steps after"
    )


def _ended_operations(run_dir: Path, job: subprocess.Popen, console: Path) -> list[dict] | None:
    assert job.poll() is None, console.read_text()[-4000:]
    return _decisions(run_dir / "scaling.jsonl")  # a line per operation ended


def _metrics(run_dir: Path) -> list[dict]:
    log = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
