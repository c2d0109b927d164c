"""Start a job's torchrun on this machine and, if it fails, say which rank and role failed.

The console shows only what rank 0 writes for the operator; every rank's own output goes to
``{run dir}/rank{R}.log`` and torchrun's to ``{run dir}/torchrun.log``. torchrun reports the
first failed worker by rank and exit code; the plan maps that rank to its roles, so the user
reads e.g. ``rank 2 (rollout[e0 head]) was killed by SIGKILL`` and the end of that rank's log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from relax_launch.inference.server import free_port
from relax_launch.placement.plan import PlacementPlan
from relax_launch.placement.render import roles_label
from relax_launch.runtime.console import rank_log_path

ENTRY_MODULE = "relax_launch.launch"  # what `relax-launch run` starts on every rank
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL)
LOG_TAIL_LINES = 30


def torchrun_command(
    script: Path | str,
    args: list[str],
    plan: PlacementPlan,
    master_port: int | None = None,
) -> list[str]:
    """torchrun on this machine running ``script``: a file, or a module name (``python -m``)."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [
        torchrun,
        *(["--module"] if isinstance(script, str) else []),
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


def failed_rank(output: str) -> tuple[int, int] | None:
    """(rank, exit code) of the first failure in torchrun's summary."""
    match = _ROOT_CAUSE.search(output)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def explain_failure(plan: PlacementPlan, output: str) -> str | None:
    """'rank R (roles) exited with code C / was killed by SIG' from torchrun's summary."""
    failed = failed_rank(output)
    if failed is None:
        return None
    rank, code = failed
    roles = roles_label(plan.ranks[rank])
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"rank {rank} ({roles}) {how}"


def failure_report(plan: PlacementPlan, log_dir: Path, code: int) -> str:
    """What failed, and the last lines of the log that says why (the failed rank's, or else
    torchrun's own)."""
    torchrun_log = log_dir / "torchrun.log"
    output = torchrun_log.read_text(errors="replace") if torchrun_log.is_file() else ""
    failed = failed_rank(output)
    log = rank_log_path(log_dir, failed[0]) if failed else torchrun_log
    reason = explain_failure(plan, output) or f"torchrun exited with code {code}"
    lines = [f"relax-launch: job failed: {reason}"]
    if log.is_file():
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        lines += [f"relax-launch: last lines of {log}:", *(f"  {line}" for line in tail)]
    return "\n".join(lines)


def run_local(
    script: Path | str,
    args: list[str],
    plan: PlacementPlan,
    log_dir: Path,
    timeout_s: float | None = None,
) -> int:
    """Run torchrun in the foreground (rank 0's console lines reach this stdout directly) and
    explain a failure on stderr."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "torchrun.log", "w") as torchrun_log:
        process = subprocess.Popen(
            torchrun_command(script, args, plan),
            stderr=torchrun_log,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=timeout_s)
        finally:
            _stop_group(process)
    if code != 0:
        print(failure_report(plan, log_dir, code), file=sys.stderr)
    return code


def _stop_group(process: subprocess.Popen) -> None:
    """torchrun and its workers share our new session: make sure none of them outlives it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
