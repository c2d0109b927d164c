"""The start-up report: each rank's phases from the first process start, and the rank the job
waited on before its first weight sync."""

from __future__ import annotations

import pytest

from relax_launch.runtime.startup import (
    FIRST_SYNC,
    SYNC_GROUPS,
    StartupClock,
    startup_report,
    summary_line,
)


def test_the_critical_path_is_the_last_phase_before_the_first_sync():
    marks = {
        0: [("process start", 100.0), ("process group", 104.0), ("trainer built", 120.0),
            (SYNC_GROUPS, 141.0), (FIRST_SYNC, 142.5)],
        1: [("process start", 101.0), ("process group", 104.0),
            ("rollout engine 0 launched", 104.5), ("rollout engine 0 ready", 140.0)],
    }  # fmt: skip
    report = startup_report(marks, {0: "trainer[tp0 pp0 dp0]", 1: "rollout[e0 head]"})
    assert report["up_s"] == pytest.approx(42.5)
    assert report["critical"] == {
        "rank": 1, "phase": "rollout engine 0 ready", "end_s": 40.0, "took_s": 35.5,
    }  # fmt: skip
    assert [p["took_s"] for p in report["ranks"][0]["phases"]] == [4.0, 16.0, 21.0, 1.5]
    line = summary_line(report)
    assert (
        line == "up in 42.5 s, waited on rank 1 (rollout[e0 head]) rollout engine 0 ready at 40.0 s"
    )


def test_a_clock_starts_at_its_process_start():
    clock = StartupClock()
    clock.mark("imports and config")
    (first, started), (second, marked) = clock.marks
    assert (first, second) == ("process start", "imports and config")
    assert started <= marked
