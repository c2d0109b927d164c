"""The shared spare pool in a real job (``pool_tiny.yaml``): trainer, a rollout engine, a genrm
engine, and one rank reserved for no role (``cluster.spare_ranks: 1``) that the pool's
autoscaler (``cluster.spare_autoscale``) moves between the rollout and judge roles, driven by the
job's own steps alone: nothing is sent to the gateway from outside.

A step's judging (a SmolLM2-135M judge asked twice per sample: two bursts of 64 requests, each
sent at once) has a first burst long enough to pay a genrm engine's start (the config's
``start_estimate_s`` is this machine's measured start): the autoscaler starts genrm's engine on
the spare during it, and the engine answers half of the second burst (a burst's requests are
queued at the engines serving when it is sent). Rollout takes the spare when its last phase's
body makes a second engine worth it and the holder has been idle for ``hold_s``: the new
rollout engine joins the next weight sync, passes the parity probe there and generates in the
next rollout phase. The two moves come in either order, each time the holder giving the rank
back first (a scale-in). The phases' times come from a sampler of the admin routes (the requests in
flight to each engine; the job's judging and its rollout are the only senders): each move is
checked against the phase it was made in and the phase it served.
``bench/pool_sim.py`` measures the gain at cluster scale.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness.processes import TEST_TAG, processes_tagged
from test_elastic_job import (
    AUTH,
    STOPPED,
    TOKEN,
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


class Phases:
    """Every 0.25 s, the requests in flight to each engine of both roles, with the time."""

    def __init__(self, gateway: str) -> None:
        self.gateway, self.samples = gateway, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.25):
            try:
                seen = {r: [e["in_flight"] for e in replicas(self.gateway, r)] for r in ROLES}
            except (httpx.HTTPError, KeyError, ValueError):
                continue  # the job is stopping
            self.samples.append((time.time(), seen))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def around(self, when: float, role: str) -> tuple[int, int]:
        """The requests in flight to ``role`` at the samples just before and after ``when``."""
        before = [sum(s[role]) for t, s in self.samples if t <= when]
        after = [sum(s[role]) for t, s in self.samples if t >= when]
        span = (self.samples[0][0], self.samples[-1][0]) if self.samples else None
        assert before and after, f"no sample on both sides of {when:.2f}: sampled {span}"
        return before[-1], after[0]

    def served(self, role: str, index: int) -> list[tuple[float, dict]]:
        """The samples where engine ``index`` of ``role`` had requests in flight."""
        return [(t, s) for t, s in self.samples if len(s[role]) > index and s[role][index]]


ROLES = ("rollout", "genrm")
HELD_BY_GENRM = "spare pool, held by smollm2-135m-instruct/1 (genrm)"  # rollout's view of it


def test_the_spare_serves_the_jobs_judging_then_its_rollout(tmp_path):
    began = time.monotonic()
    run_dir, console = tmp_path / "run", tmp_path / "console.txt"
    cli = Path(sys.executable).with_name("relax-launch")
    env = {**os.environ, "RELAX_ADMIN_TOKEN": TOKEN}
    with open(console, "w") as out:
        command = [str(cli), "run", str(HERE / "pool_tiny.yaml"), f"logging.dir={run_dir}"]
        job = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    phases = None
    try:
        gateway = wait_for("gateway.json", lambda: _gateway(run_dir, job, console))
        wait_for("the job's roles ready", lambda: _ready(gateway, job, console), 400)
        phases = Phases(gateway)
        # the moves come in either order: rollout may take the free spare after its first
        # phase, before judging has a throughput to weigh; genrm then takes it in a later one
        judge = wait_for("genrm on the spare", lambda: moved(run_dir, "genrm", "scale_out"), 500)
        wait_for("it answers judging", lambda: replicas(gateway, "genrm")[1]["answered"], 120)
        held = [r["state"] for r in replicas(gateway, "rollout")]
        view = top_once(run_dir)
        assert held[0] == "serving", held
        if held[1] != HELD_BY_GENRM or HELD_BY_GENRM not in view:
            # already idle for hold_s, genrm has given the spare back (for rollout's move, in
            # either order): then its scale-in, after its scale-out, ends
            after = operations(run_dir).index(judge) + 1
            gave = functools.partial(moved, run_dir, "genrm", "scale_in", after)
            assert wait_for("genrm gave the spare back", gave, 300), (held, view)
        back = wait_for("rollout on the spare", lambda: moved(run_dir, "rollout", "scale_out"), 300)
        wait_for("it generates", lambda: phases.served("rollout", 1), 200)
        wait_for(
            "a step with two rollout engines",
            lambda: any(r.get("rollout/engines_serving") == 2 for r in _metrics(run_dir)),
            200,
        )
    finally:
        if phases is not None:
            phases.stop()
        stopping = time.time()  # an operation the stop ends may end otherwise than succeeded
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=120)
    assert code == STOPPED, console.read_text()[-4000:]
    assert not processes_tagged(os.environ[TEST_TAG])

    # every operation the autoscaler's, with its reasons, and succeeded
    decisions = _decisions(run_dir / "autoscaler.jsonl")
    assert all(d["policy"] == "spare_pool" and d["reason"] for d in decisions), decisions
    by_id = {d.get("request_id"): d for d in decisions}
    ops = operations(run_dir)
    assert all(op["request_id"] in by_id for op in ops), ops
    assert all(op["state"] == "succeeded" for op in ops if op["finished_at"] < stopping), ops
    # genrm's move: taken while the job's judging ran and the step waited on it, and its engine
    # on the spare answered the job's judge requests (no one else sends any)
    out = by_id[judge["request_id"]]
    assert out["waiting_on"] == "genrm" and out["roles"]["genrm"]["outstanding"] > 0, out
    assert not out["roles"]["rollout"]["phase"], out
    assert min(phases.around(out["time"], "genrm")) > 0, "not during judging"
    assert phases.served("genrm", 1), "the spare's genrm engine had no judge request in flight"
    # rollout's move: for its next phase, from its last phase's body; its engine on the spare
    # had rollout requests in flight while no judging ran
    out = by_id[back["request_id"]]
    assert "the last rollout phase's body" in out["reason"], out
    generated = phases.served("rollout", 1)
    assert generated and all(sum(s["genrm"]) == 0 for _, s in generated), generated[:3]
    # the spare changed hands: the role that held it first gave it back (a scale-in)
    first, second = sorted((judge, back), key=lambda op: op["started_at"])
    given = moved(run_dir, first["role"], "scale_in")
    assert given is not None and given["started_at"] < second["started_at"], given
    # nothing lost: every step trained, every sample judged; parity after the spare's first sync
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    failed = ("reward/judge/failed", "reward/judge_again/failed", "samples_invalid")
    assert all(r[k] == 0 for r in rows for k in failed), rows
    two = [r for r in rows if r.get("rollout/engines_serving") == 2]
    assert two and all(r["sync/parity_gap"] <= 1e-4 for r in two), two[-1:]

    for op in operations(run_dir):
        move = f"{op['role']} {op['operation']} {op['from']} -> {op['target']}"
        print(f"\n{move}: {op['seconds']:.1f} s")
    for decision in decisions:
        print(f"{decision['role']} {decision['decision']}: {decision['reason']}")
    judging = [r["time/reward"] for r in rows]
    print(
        f"{len(rows)} steps (judging {min(judging):.1f}-{max(judging):.1f} s a step), "
        f"{len(two)} with two rollout engines (largest parity gap "
        f"{max(r['sync/parity_gap'] for r in two):.1e}); {time.monotonic() - began:.0f} s"
    )
