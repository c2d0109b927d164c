"""The launcher turns torchrun's failure summary into the failed rank and its roles."""

from __future__ import annotations

from relax_launch.commands.launcher import explain_failure, failure_report, next_steps
from relax_launch.config import build_config
from relax_launch.inference.config import TeacherConfig
from relax_launch.placement import plan
from relax_launch.rl.checkpoints import Checkpoints

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


def test_failure_report_ends_on_the_failed_rank_after_the_end_of_its_log(tmp_path):
    (tmp_path / "torchrun.log").write_text("E torchrun noise\n" + SUMMARY.format(rank=2, code=1))
    lines = [f"line {i}" for i in range(100)] + ["ValueError: engine 0 refused the update"]
    (tmp_path / "rank2.log").write_text("\n".join(lines))
    report = failure_report(quickstart_plan(), tmp_path, 1, advice="run it again").splitlines()
    assert report[0] == f"relax-launch: last lines of {tmp_path / 'rank2.log'}:"
    assert report[-2] == "  ValueError: engine 0 refused the update"
    assert report[-1] == (
        "relax-launch: job failed: rank 2 (rollout[e0 head]) exited with code 1; run it again"
    )
    assert len(report) == 1 + 30 + 1 and "  line 71" in report and "  line 70" not in report


def test_failure_without_a_summary_shows_torchruns_own_log(tmp_path):
    (tmp_path / "torchrun.log").write_text("torchrun: address already in use\n")
    report = failure_report(quickstart_plan(), tmp_path, 1).splitlines()
    assert report[-1] == "relax-launch: job failed: torchrun exited with code 1"
    assert report[-2] == "  torchrun: address already in use"


def test_the_log_shown_is_the_one_of_what_the_cause_names_less_library_warnings(tmp_path):
    (tmp_path / "torchrun.log").write_text(SUMMARY.format(rank=0, code=3))
    (tmp_path / "rank0.log").write_text("rank 0 only followed\n")
    (tmp_path / "rollout-engine1.log").write_text(
        "2026-12-05 08:17:14,333 INFO [rank 3 rollout] sglang: serving\n"
        "2026-12-05 08:17:14,334 WARNING [rank 3 rollout] py.warnings: /x.py:1: UserWarning: old\n"
        "  warnings.warn(\n"
        "\n"
        "2026-12-05 08:17:15,001 ERROR [rank 3 rollout] sglang: out of memory\n"
        "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: leaked\n"
        "  warnings.warn('resource_tracker: There appear to be %d '\n"
        "Traceback (most recent call last):\n"
    )
    cause = "rollout engine 1 on rank 3 (rollout[e1 head], node 0): its SGLang server was killed"
    report = failure_report(quickstart_plan(), tmp_path, 1, cause).splitlines()
    assert report == [
        f"relax-launch: last lines of {tmp_path / 'rollout-engine1.log'}:",
        "  2026-12-05 08:17:14,333 INFO [rank 3 rollout] sglang: serving",
        "  2026-12-05 08:17:15,001 ERROR [rank 3 rollout] sglang: out of memory",
        "  Traceback (most recent call last):",
        f"relax-launch: job failed: {cause}",
    ]


def test_next_steps_name_fault_tolerance_and_the_resume_command(tmp_path):
    job = build_config(
        {
            "cluster": {"nproc_per_node": 4},
            "trainer": {"model": "m", "ranks": 2},
            "rollout": {"ranks": 2},
            "data": {"prompts_per_step": 2},
            "logging": {"dir": str(tmp_path / "run")},
        }
    )
    dead_server = "rollout engine 1 on rank 3 (rollout[e1 head], node 0): its SGLang server died"
    advice = next_steps(job, ["job.yaml", "a=1"], dead_server)
    assert "rollout.fault_tolerance=true" in advice
    assert advice.endswith("no checkpoint to resume from: fix the cause and run it again")
    teacher = job.model_copy(update={"teacher": TeacherConfig(model="m")})
    dead_teacher = "teacher engine 0 on rank 2 (teacher[e0 head], node 0): its SGLang server died"
    advice = next_steps(teacher, ["job.yaml"], dead_teacher)
    assert advice.startswith("with teacher.fault_tolerance=true (decoupled) a dead teacher")
    checkpoints = Checkpoints(job.checkpoint_dir, 0)
    checkpoints.prepare(4)
    checkpoints.complete(4, {})
    advice = next_steps(job, ["job.yaml", "a=1"], "rank 1 (trainer[tp0 pp0 dp1]) died")
    assert advice == "resume from step 4 with: relax-launch run job.yaml a=1 --resume"
