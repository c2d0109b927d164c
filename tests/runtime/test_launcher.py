"""The launcher turns torchrun's failure summary into the failed rank and its roles."""

from __future__ import annotations

from relax_launch.config import build_config
from relax_launch.placement import plan
from relax_launch.placement.render import roles_label
from relax_launch.runtime.launcher import explain_failure, label_line

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


def test_no_summary_no_explanation():
    assert explain_failure(quickstart_plan(), "all good") is None


def test_rank_lines_are_labelled_with_rank_and_roles():
    labels = {r.rank: roles_label(r) for r in quickstart_plan().ranks}
    assert label_line("[default2]:engine up\n", labels) == "[rank 2 rollout[e0 head]] engine up\n"
    assert label_line("torchrun: summary\n", labels) == "torchrun: summary\n"
