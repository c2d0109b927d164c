"""Start a job's torchrun on this machine and, if it fails, say which rank and role failed.

Every line a rank prints is prefixed with its rank and roles (``[rank 2 rollout[e0 head]]``).
torchrun reports the first failed worker by rank and exit code; the plan maps that rank to its
roles, so the user reads e.g. ``rank 2 (rollout[e0 head]) was killed by SIGKILL``.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from relax_launch.inference.server import free_port
from relax_launch.placement.plan import PlacementPlan
from relax_launch.placement.render import roles_label

REPO_LAUNCH = Path(__file__).resolve().parents[2] / "launch.py"
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL)
_TEE_PREFIX = re.compile(r"^\[default(\d+)\]:")  # torchrun --tee: [<role><local rank>]:


def torchrun_command(
    script: Path,
    args: list[str],
    plan: PlacementPlan,
    master_port: int | None = None,
    tee: bool = False,
) -> list[str]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [
        torchrun,
        *(["--tee", "3"] if tee else []),  # each worker's lines, prefixed with its local rank
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(plan.nproc_per_node),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master_port or free_port()),
        str(script),
        *args,
    ]


def explain_failure(plan: PlacementPlan, output: str) -> str | None:
    """'rank R (roles) exited with code C / was killed by SIG' from torchrun's summary."""
    match = _ROOT_CAUSE.search(output)
    if match is None:
        return None
    rank, code = int(match.group(1)), int(match.group(2))
    roles = roles_label(plan.ranks[rank])
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"rank {rank} ({roles}) {how}"


def label_line(line: str, labels: dict[int, str]) -> str:
    """``[default2]:text`` -> ``[rank 2 rollout[e0 head]] text`` (one machine: local = global)."""
    match = _TEE_PREFIX.match(line)
    if match is None:
        return line
    rank = int(match.group(1))
    return f"[rank {rank} {labels.get(rank, '?')}] {line[match.end() :]}"


def run_local(
    script: Path, args: list[str], plan: PlacementPlan, timeout_s: float | None = None
) -> int:
    """Run torchrun in the foreground, echo its output, and explain a failure on stderr."""
    process = subprocess.Popen(
        torchrun_command(script, args, plan, tee=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    tail: collections.deque[str] = collections.deque(maxlen=400)
    labels = {r.rank: roles_label(r) for r in plan.ranks}
    try:
        for line in process.stdout:
            sys.stdout.write(label_line(line, labels))
            tail.append(line)
        code = process.wait(timeout=timeout_s)
    finally:
        _stop_group(process)
    if code != 0:
        reason = explain_failure(plan, "".join(tail))
        print(
            f"relax-launch: job failed: {reason or f'torchrun exited with code {code}'}",
            file=sys.stderr,
        )
    return code


def _stop_group(process: subprocess.Popen[str]) -> None:
    """torchrun and its workers share our new session: make sure none of them outlives it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
