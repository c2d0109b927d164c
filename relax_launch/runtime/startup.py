"""Where a job's start-up time goes. Each rank marks the start-up phases it finishes; after the
first weight sync rank 0 gathers every rank's marks and reports them, with the critical path:
the rank whose last phase before that sync ended last, which the job waited on.

Marks are wall-clock times; the report counts from the earliest process start of any rank.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import psutil

from relax_launch.runtime.control import Command

Marks = list[tuple[str, float]]  # (phase finished, epoch seconds), in order
# Rank 0's phases once every rank is ready: what the job waited on came before them.
SYNC_GROUPS, FIRST_SYNC = "weight-sync groups", "first weight sync"


class StartupClock:
    """The start-up phases this rank finished, from its own process start."""

    def __init__(self) -> None:
        self.marks: Marks = [("process start", psutil.Process().create_time())]

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.time()))


@dataclass(frozen=True)
class StartupMarks(Command):
    """Every rank's start-up marks (answered by each rank's clock)."""

    op: ClassVar[str] = "startup.marks"


def startup_report(marks: dict[int, Marks], labels: dict[int, str]) -> dict[str, Any]:
    """Per rank, each phase's end and duration (seconds from the first process start), and the
    critical path: rank 0's last mark is the job being up; before its weight sync it waited for
    the rank whose other phases ended last."""
    origin = min(m[0][1] for m in marks.values())
    ranks = {}
    for rank, rank_marks in sorted(marks.items()):
        phases = [
            {"phase": phase, "end_s": round(at - origin, 3), "took_s": round(at - before, 3)}
            for (phase, at), (_, before) in zip(rank_marks[1:], rank_marks, strict=False)
        ]
        ranks[rank] = {"label": labels.get(rank, ""), "phases": phases}
    before_sync = [
        (rank, phase)
        for rank, entry in ranks.items()
        for phase in entry["phases"]
        if phase["phase"] not in (SYNC_GROUPS, FIRST_SYNC)
    ]
    waited_on = max(before_sync, key=lambda item: item[1]["end_s"])
    up_s = max(ranks[0]["phases"][-1]["end_s"], waited_on[1]["end_s"])  # no sync: the last rank
    return {"up_s": up_s, "critical": {"rank": waited_on[0], **waited_on[1]}, "ranks": ranks}


def summary_line(report: dict[str, Any]) -> str:
    """One clause for the "job is up" line: total, and what the job waited on."""
    critical = report["critical"]
    label = report["ranks"][critical["rank"]]["label"]
    return (
        f"up in {report['up_s']:.1f} s, waited on rank {critical['rank']} ({label}) "
        f"{critical['phase']} at {critical['end_s']:.1f} s"
    )


def write_report(report: dict[str, Any], log_dir: Path) -> Path:
    path = log_dir / "startup.json"
    path.write_text(json.dumps(report, indent=2))
    return path
