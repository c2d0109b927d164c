"""The shared spare pool in a real job (``pool_tiny.yaml``): trainer, a rollout engine, a genrm
engine, and one rank reserved for no role (``cluster.spare_ranks: 1``) that the pool's
autoscaler (``cluster.spare_autoscale``) moves between the rollout and judge roles.

Under a burst of judge requests from outside the spare serves genrm; once the burst is over it
serves rollout, joining the weight sync (the parity probe checks it after its first sync). Each
move is the autoscaler's, logged with its reasons; every judge request is answered and every
step trains; ``relax-launch top`` shows who holds the pool. On this machine the judge phases of
the job's own steps are too short to pay a CPU engine's start (tens of seconds), hence the
burst; ``bench/pool_sim.py`` measures the gain at cluster scale.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from harness.processes import TEST_TAG, processes_tagged
from test_elastic_job import (
    AUTH,
    STOPPED,
    TOKEN,
    Burst,
    _decisions,
    _gateway,
    _metrics,
    _ready,
    top_once,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HERE = Path(__file__).parent


def operations(run_dir: Path) -> list[dict]:
    return _decisions(run_dir / "scaling.jsonl") or []  # a line per operation ended


def moved(run_dir: Path, role: str, kind: str, after: int = 0) -> dict | None:
    """The first operation of ``role`` and ``kind`` ended after the first ``after`` ones."""
    return next(
        (op for op in operations(run_dir)[after:] if (op["role"], op["operation"]) == (role, kind)),
        None,
    )


def replicas(gateway: str, role: str) -> list[dict]:
    document = httpx.get(f"{gateway}/{role}/admin/engines", headers=AUTH, timeout=10).json()
    return document["replicas"]


def test_the_spare_serves_the_judge_under_its_burst_then_rollout(tmp_path):
    began = time.monotonic()
    run_dir, console = tmp_path / "run", tmp_path / "console.txt"
    cli = Path(sys.executable).with_name("relax-launch")
    env = {**os.environ, "RELAX_ADMIN_TOKEN": TOKEN}
    with open(console, "w") as out:
        command = [str(cli), "run", str(HERE / "pool_tiny.yaml"), f"logging.dir={run_dir}"]
        job = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    burst = None
    try:
        gateway = wait_for("gateway.json", lambda: _gateway(run_dir, job, console))
        wait_for("the job's roles ready", lambda: _ready(gateway, job, console), 400)
        burst = Burst(gateway, workers=48)
        judge = wait_for("genrm on the spare", lambda: moved(run_dir, "genrm", "scale_out"), 600)
        assert judge["state"] == "succeeded" and judge["source"] == "autoscaler", judge
        wait_for("its judge answers", lambda: replicas(gateway, "genrm")[1]["answered"] >= 5, 120)
        held = [r["state"] for r in replicas(gateway, "rollout")]
        assert held == ["serving", "spare pool, held by tiny-llama/1 (genrm)"], held
        view = top_once(run_dir)
        assert "spare pool, held by tiny-llama/1 (genrm)" in view, view
        burst.stop()
        assert burst.failures == [] and burst.answered == burst.sent > 0, burst.failures[:5]

        after = operations(run_dir).index(judge) + 1
        back = wait_for(
            "rollout on the spare", lambda: moved(run_dir, "rollout", "scale_out", after), 400
        )
        assert back["state"] == "succeeded" and back["source"] == "autoscaler", back
        given = moved(run_dir, "genrm", "scale_in", after)
        assert given["state"] == "succeeded" and given["source"] == "autoscaler", given
        routed_at = len(_metrics(run_dir))
        wait_for(
            "3 steps with two rollout engines", lambda: len(_metrics(run_dir)) >= routed_at + 3, 180
        )
        rollout = replicas(gateway, "rollout")
        assert [r["state"] for r in rollout] == ["serving", "serving"], rollout
        assert rollout[1]["answered"] > 0, rollout
        genrm = [r["state"] for r in replicas(gateway, "genrm")]
        assert genrm == ["serving", "spare pool, held by tiny-llama/1 (rollout)"], genrm
    finally:
        if burst is not None:
            burst.stop()
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=120)
    assert code == STOPPED, console.read_text()[-4000:]
    assert not processes_tagged(os.environ[TEST_TAG])
    # every move the autoscaler's, each with its reasons; every operation succeeded
    decisions = _decisions(run_dir / "autoscaler.jsonl")
    assert all(d["policy"] == "spare_pool" and d["reason"] for d in decisions), decisions
    ids = {d.get("request_id") for d in decisions}
    assert all(op["request_id"] in ids and op["state"] == "succeeded" for op in operations(run_dir))
    # the rollout engine on the spare passed the parity probe at every sync it took part in
    rows = _metrics(run_dir)
    two = [r for r in rows if r.get("rollout/engines_serving") == 2]
    assert two and all(r["sync/parity_gap"] <= 1e-4 for r in two), two[-1:]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # every step trained
    for op in operations(run_dir):
        move = f"{op['role']} {op['operation']} {op['from']} -> {op['target']}"
        print(f"\n{move}: {op['seconds']:.1f} s")
    for decision in decisions:
        print(f"{decision['role']} {decision['decision']}: {decision['reason']}")
    gaps = max(r["sync/parity_gap"] for r in two)
    print(
        f"judge requests answered: {burst.answered}; {len(rows)} steps, {len(two)} with two "
        f"rollout engines (largest parity gap {gaps:.1e}); {time.monotonic() - began:.0f} s"
    )
