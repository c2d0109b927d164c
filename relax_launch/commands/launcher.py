"""Start a job's torchrun on this machine and, if it fails, say which rank and role failed.

The console shows only what rank 0 writes for the operator; every rank's own output goes to
``{run dir}/rank{R}.log`` and torchrun's to ``{run dir}/torchrun.log``. torchrun reports the
first failed worker by rank and exit code; the plan maps that rank to its roles, so the user
reads e.g. ``rank 2 (rollout[e0 head]) was killed by SIGKILL`` and the end of that rank's log.
With ``cluster.max_restarts`` a failed job may instead start again from its newest checkpoint
(``restarts.py`` decides; this command's loop runs it again).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from relax_launch.commands.restarts import (
    Decision,
    Restarts,
    restart_cost,
    restart_line,
    resume_args,
)
from relax_launch.config.job import JobConfig
from relax_launch.deadline import Deadline
from relax_launch.inference.process import die_with_parent, free_port
from relax_launch.notify import SEND_BOUND_S, Notifier
from relax_launch.placement.plan import PlacementPlan
from relax_launch.placement.render import roles_label
from relax_launch.rl.checkpoints import Checkpoints
from relax_launch.run_dir import (
    END_RECORD,
    EXIT_ABORTED,
    EXIT_STOPPED,
    JOB_STARTED_ENV,
    LAUNCHER_ENV,
    STOP_FILE,
    rank_log_path,
    read_end_record,
    resume_command,
)
from relax_launch.runtime.stop import signal_name

ENTRY_MODULE = "relax_launch.launch"  # what `relax-launch run` starts on every rank
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL)
_FAILURE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL)
_ENGINE = re.compile(r"\b(rollout|teacher|genrm) engine (\d+)\b")
_RANK = re.compile(r"\brank (\d+) \(")
_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")  # a log record's first line
_WARNING = re.compile(r"\.py:\d+: \w*Warning: ")  # how Python prints a warning
LOG_TAIL_LINES = 30
GROUP_EXIT_S = 45.0  # a job asked to stop by this command is gone well within this


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
    roles = roles_label(plan, plan.ranks[rank])
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"rank {rank} ({roles}) {how}"


def failure_report(
    plan: PlacementPlan, log_dir: Path, code: int, cause: str | None = None, advice: str = ""
) -> str:
    """The end of the log that says why (the engine's or rank's that ``cause`` names, else the
    rank torchrun saw fail, else torchrun's own), without library warnings; then, last, one
    line: what failed and, with ``advice``, what to do next."""
    torchrun_log = log_dir / "torchrun.log"
    output = _torchrun_output(log_dir)
    failed = failed_rank(output)
    cause = cause or explain_failure(plan, output) or f"torchrun exited with code {code}"
    log = _log_naming(cause, log_dir) or (
        rank_log_path(log_dir, failed[0]) if failed else torchrun_log
    )
    lines = []
    if log.is_file():
        tail = operator_tail(log.read_text(errors="replace"), LOG_TAIL_LINES)
        lines += [f"relax-launch: last lines of {log}:", *(f"  {line}" for line in tail)]
    lines.append(f"relax-launch: job failed: {cause}" + (f"; {advice}" if advice else ""))
    return "\n".join(lines)


def _log_naming(cause: str, log_dir: Path) -> Path | None:
    """The log of the engine or rank a cause names first, if it exists."""
    candidates = []
    if engine := _ENGINE.search(cause):
        candidates.append(log_dir / f"{engine[1]}-engine{engine[2]}.log")
    if rank := _RANK.search(cause):
        candidates.append(rank_log_path(log_dir, int(rank[1])))
    return next((path for path in candidates if path.is_file()), None)


def operator_tail(text: str, count: int) -> list[str]:
    """The last ``count`` lines of a log, less library warnings: a rank log's ``py.warnings``
    records, and any ``file.py:N: SomeWarning:`` line with the indented source lines after it
    (what Python prints itself, in an engine's log)."""
    kept, dropping = [], False
    for line in text.splitlines():
        if _RECORD.match(line):
            dropping = " py.warnings: " in line
        elif _WARNING.search(line):
            dropping = True
        elif dropping and not line.startswith((" ", "\t")) and line.strip():
            dropping = False  # the end of a warning printed by Python
        if not dropping:
            kept.append(line)
    return kept[-count:]


def next_steps(job: JobConfig, args: list[str], cause: str) -> str:
    """What the operator can do after a failure: the option that would have kept the job
    going, and the command that resumes it from its newest checkpoint."""
    steps = []
    dead = re.search(r"\b(rollout|teacher|genrm) engine \d+ on rank .*SGLang server", cause)
    section = job.inference_roles().get(dead.group(1)) if dead else None
    if section is not None and not section.fault_tolerance and not section.prefill:
        role = dead.group(1)
        needs = "decoupled, 2+ rollout engines" if role == "rollout" else "decoupled"
        steps.append(
            f"with {role}.fault_tolerance=true ({needs}) a dead {role} engine is restarted and "
            "the job goes on"
        )
    newest = Checkpoints(job.checkpoint_dir, job.checkpoint.keep_last).newest()
    if newest is not None:
        steps.append(f"resume from step {newest[0]} with: {resume_command(args)}")
    else:
        steps.append("no checkpoint to resume from: fix the cause and run it again")
    return "; ".join(steps)


def run_local(
    script: Path | str,
    args: list[str],
    plan: PlacementPlan,
    job: JobConfig,
    timeout_s: float | None = None,
) -> int:
    """Run torchrun in the foreground (rank 0's console lines reach this stdout directly) and
    explain a failure on stderr; returns the job's exit code (``EXIT_STOPPED`` when it stopped
    on request and can be resumed).

    With ``cluster.max_restarts`` a failed job, once every process of it is gone, starts again
    from its newest checkpoint when ``restarts.decide`` says so (one console line, a row of the
    run's ``restarts.jsonl``); ``logging.notify`` hears of each restart and of how the job ended.
    """
    notifier = Notifier(job.logging.notify, job.name)
    restarts = Restarts(job, time.time())
    while True:
        code, stop_asked = _run_torchrun(script, args, plan, job, timeout_s)
        if (row := restarts.started_up()) is not None:
            print(restart_cost(row), file=sys.stderr, flush=True)
        cause = _failure(plan, job, code)
        if cause is None:
            return _success_or_stop(job, code, notifier)
        if stop_asked:
            decision = Decision(False, "relax-launch run was asked to stop")
        else:
            decision = restarts.decide(cause, code)
        if not decision.restart:
            return _report_failure(plan, job, args, code, cause, decision, notifier)
        line = restart_line(cause, decision, job)
        print(line, file=sys.stderr, flush=True)
        notifier.send("restarted", line)
        torchrun_log = job.log_dir / "torchrun.log"  # the next run's torchrun writes anew
        os.replace(torchrun_log, torchrun_log.with_suffix(f".before-restart{decision.step}.log"))
        args = resume_args(args)


def _run_torchrun(
    script: Path | str,
    args: list[str],
    plan: PlacementPlan,
    job: JobConfig,
    timeout_s: float | None,
) -> tuple[int, bool]:
    """One run of the job, until every process of it is gone: torchrun's exit code, and
    whether this command was asked to stop meanwhile.

    The first Ctrl-C (or SIGTERM to this command) asks the job to stop: it writes the run's
    ``STOP`` file, which rank 0 acts on (``runtime/stop.py``); torchrun is not signalled, since it
    would give the ranks only 30 s. The second Ctrl-C kills it all now. If this command dies,
    torchrun gets SIGTERM (its parent-death signal) and passes it on to every rank.
    """
    log_dir = job.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / END_RECORD).unlink(missing_ok=True)
    (log_dir / STOP_FILE).unlink(missing_ok=True)
    marker = repr(time.time())  # when the job started, and the mark of its processes
    env = dict(os.environ, **{JOB_STARTED_ENV: marker, LAUNCHER_ENV: "1"})
    with open(log_dir / "torchrun.log", "w") as torchrun_log:
        process = subprocess.Popen(
            torchrun_command(script, args, plan),
            stderr=torchrun_log,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM),  # a stop: torchrun passes it on
        )
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for signum in previous:
            signal.signal(signum, lambda signum, _: _ask_to_stop(process, log_dir, signum, marker))
        try:
            code = process.wait(timeout=timeout_s)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            _stop_group(process, log_dir, marker)
    return code, getattr(process, "stop_asked", False)


def _ask_to_stop(process: subprocess.Popen, log_dir: Path, signum: int, marker: str) -> None:
    if getattr(process, "stop_asked", False):
        print("relax-launch: stopping now, without a checkpoint", file=sys.stderr)
        for victim in job_processes(marker):  # every rank and server, not only torchrun
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.kill()
        return
    process.stop_asked = True
    (log_dir / STOP_FILE).write_text(f"{signal_name(signum)} to relax-launch run\n")
    print(
        f"relax-launch: {signal_name(signum)}: asking the job to stop (Ctrl-C again to stop at "
        "once, without a checkpoint)",
        file=sys.stderr,
    )


def _failure(plan: PlacementPlan, job: JobConfig, code: int) -> str | None:
    """What failed, or None for a job that completed or stopped: rank 0's end record says how
    it ended, torchrun's summary which rank failed when rank 0 could not say."""
    record = read_end_record(job.log_dir)
    if record is not None and record["state"] == "stopped":
        return None
    if code == 0 and (record is None or record["state"] == "completed"):
        return None
    cause = record["reason"] if record is not None and record["state"] == "failed" else None
    cause = cause or explain_failure(plan, _torchrun_output(job.log_dir))
    return cause or f"torchrun exited with code {code}"


def _success_or_stop(job: JobConfig, code: int, notifier: Notifier) -> int:
    """The exit code of a job that completed (0) or stopped on request (``EXIT_STOPPED``)."""
    record = read_end_record(job.log_dir) or {"state": "completed", "reason": "every step ran"}
    resume = f"; resume with: {record['resume']}" if record.get("resume") else ""
    event = "stopped" if record["state"] == "stopped" else "finished"
    notifier.send(event, f"{record['reason']}{resume} ({job.log_dir})", wait_s=SEND_BOUND_S)
    return EXIT_STOPPED if event == "stopped" else 0


def _report_failure(
    plan: PlacementPlan,
    job: JobConfig,
    args: list[str],
    code: int,
    cause: str,
    decision: Decision,
    notifier: Notifier,
) -> int:
    """The failure explained on stderr, its last line (why it was not restarted, when
    restarts are on; what to do next) to ``logging.notify``; returns the job's exit code."""
    advice = next_steps(job, args, cause)
    if job.cluster.max_restarts:
        advice = f"not restarted: {decision.reason}; {advice}"
    report = failure_report(plan, job.log_dir, code, cause, advice)
    print(report, file=sys.stderr)
    notifier.send("failed", report.splitlines()[-1], wait_s=SEND_BOUND_S)
    return 128 - code if code < 0 else code or 1  # killed by signal N: 128 + N, as a shell says


def _torchrun_output(log_dir: Path) -> str:
    path = log_dir / "torchrun.log"
    return path.read_text(errors="replace") if path.is_file() else ""


def _stop_group(process: subprocess.Popen, log_dir: Path, marker: str) -> None:
    """torchrun, its ranks (each in a session of its own) and their servers all carry this
    command's ``marker``: none of them outlives it. Ranks whose agent died leave by themselves
    within seconds (their watchdogs notice, and rank 0 writes the end record); a job still
    running here (a timeout, an error in this command) is asked to stop first; whatever is left
    after ``GROUP_EXIT_S`` is killed by PID."""
    if process.poll() is None:
        (log_dir / STOP_FILE).write_text("relax-launch run is ending\n")
    deadline = Deadline(GROUP_EXIT_S)
    while job_processes(marker) and not deadline.passed:
        process.poll()
        time.sleep(0.2)
    for leftover in job_processes(marker):
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()
    process.wait()


def job_processes(marker: str) -> list[psutil.Process]:
    """The live processes of the job this command started (they inherit ``marker``)."""
    found = []
    for candidate in psutil.process_iter():
        try:
            if candidate.status() == psutil.STATUS_ZOMBIE or candidate.pid == os.getpid():
                continue
            if candidate.environ().get(JOB_STARTED_ENV) == marker:
                found.append(candidate)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
