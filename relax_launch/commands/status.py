"""``relax-launch status RUN_DIR|JOB_ID``: where a job is, from what it leaves behind.

The run directory says most of it: ``end.json`` (how it ended), ``metrics.jsonl`` (the last
step), ``gateway.json`` (its address), ``startup.json``, ``restarts.jsonl`` (its restarts). A
live gateway adds its engines (``GET /{role}/engines``). A Slurm job id is turned into its run
directory (``{logging.dir}/job-<id>``, beside the job's ``slurm-<id>.out``) and its Slurm state.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from relax_launch import http
from relax_launch.run_dir import read_end_record, read_json

GATEWAY_TIMEOUT_S = 3.0


def job_status(run: str) -> dict[str, Any]:
    """The status of the run in directory ``run``, or of Slurm job ``run``."""
    status: dict[str, Any] = {}
    run_dir = Path(run)
    if not run_dir.is_dir() and run.isdigit():
        status["slurm"] = slurm_job(run)
        run_dir = Path(status["slurm"]["StdOut"]).parent / f"job-{run}"
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir} (the job has not started yet?)")
    status["run_dir"] = str(run_dir)
    end = read_end_record(run_dir)
    status["state"] = end["state"] if end else "running"
    if end:
        status["end"] = end
    status["last_step"] = _last_line(run_dir / "metrics.jsonl")
    restarts = run_dir / "restarts.jsonl"  # commands/restarts.py (cluster.max_restarts)
    if restarts.is_file():
        status["restarts"] = [json.loads(line) for line in restarts.read_text().splitlines()]
    gateway = read_json(run_dir / "gateway.json")
    if gateway:
        status["gateway"] = gateway["url"]
        if end is None:
            status["engines"] = {
                role: _get(f"{gateway['url']}/{role}/engines") for role in gateway["roles"]
            }
    return status


def slurm_job(job_id: str) -> dict[str, str]:
    """``scontrol show job`` of ``job_id`` as a dict (JobState, StdOut, NodeList, ...)."""
    result = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise RuntimeError(f"scontrol show job {job_id}: {result.stderr.strip()}")
    fields = {}
    for item in result.stdout.split():
        key, _, value = item.partition("=")
        fields[key] = value
    return fields


def render_status(status: dict[str, Any]) -> str:
    """A few lines for the operator."""
    lines = [f"run: {status['run_dir']}"]
    if "slurm" in status:
        slurm = status["slurm"]
        lines.append(
            f"slurm: job {slurm.get('JobId')} {slurm.get('JobState')} on {slurm.get('NodeList')}"
        )
    lines.append(f"state: {status['state']}")
    end = status.get("end")
    if end:
        lines.append(f"ended: {end['reason']}")
        if end.get("resume"):
            lines.append(f"resume: {end['resume']}")
    step = status.get("last_step")
    if step:
        shown = {k: step[k] for k in ("step", "reward", "loss") if k in step}
        lines.append(
            "last step: "
            + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()
            )
        )
    if restarts := status.get("restarts"):
        last = restarts[-1]
        lines.append(
            f"restarts: {len(restarts)}; the last from step {last['resumed_step']} after "
            f"{last['cause']}"
        )
    if status.get("gateway"):
        lines.append(f"gateway: {status['gateway']}")
    for role, engines in status.get("engines", {}).items():
        lines.append(f"{role}: {json.dumps(engines)}")
    return "\n".join(lines)


def _get(url: str) -> Any:
    try:
        reply = http.call("GET", url, timeout_s=GATEWAY_TIMEOUT_S)
        return reply.json() if reply.ok else f"HTTP {reply.status}"
    except (http.TransportError, TimeoutError, ValueError) as exc:
        return f"unreachable ({type(exc).__name__})"


def _last_line(path: Path) -> dict[str, Any] | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return json.loads(lines[-1]) if lines else None
