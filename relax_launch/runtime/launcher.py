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
import time
from pathlib import Path

from relax_launch.inference.process import die_with_parent, free_port, group_alive
from relax_launch.placement.plan import PlacementPlan
from relax_launch.placement.render import roles_label
from relax_launch.runtime.console import rank_log_path
from relax_launch.runtime.stop import END_RECORD, EXIT_ABORTED, EXIT_STOPPED, read_end_record

ENTRY_MODULE = "relax_launch.launch"  # what `relax-launch run` starts on every rank
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL)
_FAILURE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL)
LOG_TAIL_LINES = 30
GROUP_EXIT_S = 45.0  # torchrun gives its ranks 30 s after SIGTERM, then kills them


def torchrun_command(
    script: Path | str,
    args: list[str],
    plan: PlacementPlan,
    master_port: int | None = None,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
) -> list[str]:
    """torchrun running ``script`` (a file, or a module name: ``python -m``) as node
    ``node_rank`` of the plan's nodes; node 0, the master, is at ``master_addr``. Static
    rendezvous: node k of the plan is the agent given node rank k."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [
        torchrun,
        *(["--module"] if isinstance(script, str) else []),
        *("--nnodes", str(plan.nnodes), "--node-rank", str(node_rank)),
        *("--nproc-per-node", str(plan.nproc_per_node)),
        *("--master-addr", master_addr, "--master-port", str(master_port or free_port())),
        str(script),
        *args,
    ]


def failed_rank(output: str) -> tuple[int, int] | None:
    """(rank, exit code) of the first failure in torchrun's summary, unless that rank only
    followed another's: a rank its watchdog ended (``EXIT_ABORTED``) may leave before the rank
    whose death it saw is reaped, so torchrun can observe it first."""
    match = _ROOT_CAUSE.search(output)
    if match is None:
        return None
    root = (int(match.group(1)), int(match.group(2)))
    summary = output[output.rfind("Failures:", 0, match.start()) : match.end()]
    causes = [(int(r), int(c)) for r, c in _FAILURE.findall(summary) if int(c) != EXIT_ABORTED]
    return root if root[1] != EXIT_ABORTED or not causes else causes[0]


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
    explain a failure on stderr; returns the job's exit code (``EXIT_STOPPED`` when it stopped
    on request and can be resumed).

    The first Ctrl-C (or SIGTERM to this command) asks the job to stop after a checkpoint: torchrun
    passes SIGTERM on to every rank, and rank 0 stops them in order. The second kills it all now.
    If this command dies, torchrun gets SIGTERM (its parent-death signal) and does the same.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / END_RECORD).unlink(missing_ok=True)
    with open(log_dir / "torchrun.log", "w") as torchrun_log:
        process = subprocess.Popen(
            torchrun_command(script, args, plan),
            stderr=torchrun_log,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM),  # a stop: torchrun passes it on
        )
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for signum in previous:
            signal.signal(signum, lambda signum, frame: _ask_to_stop(process))
        try:
            code = process.wait(timeout=timeout_s)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            _stop_group(process)
    return _outcome(plan, log_dir, code)


def _ask_to_stop(process: subprocess.Popen) -> None:
    if getattr(process, "stop_asked", False):
        print("relax-launch: stopping now", file=sys.stderr)
        os.killpg(process.pid, signal.SIGKILL)
        return
    process.stop_asked = True
    print(
        "relax-launch: stopping after a checkpoint (Ctrl-C again to stop at once)",
        file=sys.stderr,
    )
    process.send_signal(signal.SIGTERM)  # torchrun only: it passes it on to every rank once


def _outcome(plan: PlacementPlan, log_dir: Path, code: int) -> int:
    """The job's exit code, explained: rank 0's end record says how it ended, torchrun's
    summary which rank failed when rank 0 could not say."""
    record = read_end_record(log_dir)
    if record is not None and record["state"] == "stopped":
        return EXIT_STOPPED
    if code == 0 and (record is None or record["state"] == "completed"):
        return 0
    report = failure_report(plan, log_dir, code)
    if record is not None and record["state"] == "failed":
        report = report.replace(
            report.splitlines()[0], f"relax-launch: job failed: {record['reason']}", 1
        )
    print(report, file=sys.stderr)
    return 128 - code if code < 0 else code or 1  # killed by signal N: 128 + N, as a shell says


def _stop_group(process: subprocess.Popen) -> None:
    """torchrun and its ranks share our new session: none of them outlives this command. Ranks
    whose agent died leave by themselves within seconds (their watchdogs notice); a job still
    running here (a timeout, an error in this command) is asked to stop first; whatever is left
    after ``GROUP_EXIT_S`` is killed."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GROUP_EXIT_S
    while group_alive(process.pid) and time.monotonic() < deadline:
        process.poll()
        time.sleep(0.2)
    if group_alive(process.pid):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
