"""The launcher turns torchrun's failure summary into the failed rank and its roles."""

from __future__ import annotations

from relax_launch.config import build_config
from relax_launch.placement import plan
from relax_launch.runtime.launcher import explain_failure, failure_report

SUMMARY = """
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_11:23:51
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 13390)
"""


def quickstart_plan():
    return plan(
        build_config(
            {
                "cluster": {"nproc_per_node": 4},
                "trainer": {"model": "m", "ranks": 2},
                "rollout": {"ranks": 2},
                "data": {"prompts_per_step": 2},
            }
        )
    )


def test_signal_death_names_rank_role_and_signal():
    text = explain_failure(quickstart_plan(), SUMMARY.format(rank=3, code=-9))
    assert text == "rank 3 (rollout[e1 head]) was killed by SIGKILL"


def test_exit_code_names_rank_and_role():
    text = explain_failure(quickstart_plan(), SUMMARY.format(rank=1, code=1))
    assert text == "rank 1 (trainer[tp0 pp0 dp1]) exited with code 1"


def test_a_rank_its_watchdog_ended_is_not_the_cause_even_when_observed_first():
    # rank 1 saw rank 3 die and left (exit 3) before torchrun reaped rank 3
    other = """
Failures:
[1]:
  time      : 2026-12-02_11:23:51
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : -9 (pid: 13391)
------------------------------------------------------------"""
    text = explain_failure(quickstart_plan(), other + SUMMARY.format(rank=1, code=3))
    assert text == "rank 3 (rollout[e1 head]) was killed by SIGKILL"
    alone = explain_failure(quickstart_plan(), SUMMARY.format(rank=1, code=3))
    assert alone == "rank 1 (trainer[tp0 pp0 dp1]) exited with code 3"  # nothing better known


def test_no_summary_no_explanation():
    assert explain_failure(quickstart_plan(), "all good") is None


def test_failure_report_names_the_rank_and_shows_the_end_of_its_log(tmp_path):
    (tmp_path / "torchrun.log").write_text("E torchrun noise\n" + SUMMARY.format(rank=2, code=1))
    lines = [f"line {i}" for i in range(100)] + ["ValueError: engine 0 refused the update"]
    (tmp_path / "rank2.log").write_text("\n".join(lines))
    report = failure_report(quickstart_plan(), tmp_path, 1).splitlines()
    assert report[0] == "relax-launch: job failed: rank 2 (rollout[e0 head]) exited with code 1"
    assert report[1] == f"relax-launch: last lines of {tmp_path / 'rank2.log'}:"
    assert report[-1] == "  ValueError: engine 0 refused the update"
    assert len(report) == 2 + 30 and "  line 71" in report and "  line 70" not in report


def test_failure_without_a_summary_shows_torchruns_own_log(tmp_path):
    (tmp_path / "torchrun.log").write_text("torchrun: address already in use\n")
    report = failure_report(quickstart_plan(), tmp_path, 1).splitlines()
    assert report[0] == "relax-launch: job failed: torchrun exited with code 1"
    assert report[-1] == "  torchrun: address already in use"
