"""``relax-launch top RUN_DIR|URL``: a live terminal view of a running job.

What it shows, read again every ``--interval`` seconds: the step, its reward and the time left
(``metrics.jsonl`` and ``job.json`` of the run directory); per inference role, each engine's
state, requests queued and running, tokens per second (its own ``/v1/loads``), weight version
(its ``/model_info``) and requests answered; the scale operation in flight; the last error (the
end record of a failed run, or a scale operation that failed). The gateway's admin routes add
the reserved engines and the operations; they need the admin token (``--token-env``), without
it the view shows the routable engines (discovery). Given a gateway URL, the run directory is
asked of the gateway (``GET /job``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from relax_launch import http
from relax_launch.inference.engine_load import engine_load
from relax_launch.run_dir import read_end_record, read_json

TIMEOUT_S = 3.0


@dataclass
class Frame:
    """One reading of the job."""

    run_dir: Path | None
    gateway: str | None
    header: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)
    operations: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def locate(target: str) -> tuple[Path | None, str | None]:
    """(run directory, gateway URL) of ``target``: a run directory or a gateway URL."""
    if target.startswith(("http://", "https://")):
        gateway = target.rstrip("/")
        job = _get(f"{gateway}/job")
        run_dir = Path(job["run_dir"]) if isinstance(job, dict) and job.get("run_dir") else None
        return (run_dir if run_dir is not None and run_dir.is_dir() else None), gateway
    run_dir = Path(target)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir} (the job has not started yet?)")
    record = read_json(run_dir / "gateway.json")
    return run_dir, record["url"] if record else None


def read_frame(run_dir: Path | None, gateway: str | None, token: str | None) -> Frame:
    frame = Frame(run_dir, gateway)
    if run_dir is not None:
        frame.header, frame.error = _progress(run_dir)
    end = read_end_record(run_dir) if run_dir is not None else None
    if gateway is None or end is not None:
        return frame
    auth = {"authorization": f"Bearer {token}"} if token else None
    job = _get(f"{gateway}/job")
    for role in job.get("roles", []) if isinstance(job, dict) else []:
        admin = _get(f"{gateway}/{role}/admin/engines", auth) if auth else None
        if isinstance(admin, dict) and "engines" in admin:
            frame.roles[role] = {"engines": _admin_rows(admin)}
            if admin.get("operation"):
                frame.operations.append(admin["operation"])
        else:
            frame.roles[role] = {"engines": _discovery_rows(_get(f"{gateway}/{role}/engines"))}
    return frame


def _progress(run_dir: Path) -> tuple[dict[str, Any], str | None]:
    """Step, reward and ETA from the run directory; the last error it records."""
    rows = _json_lines(run_dir / "metrics.jsonl")
    job = read_json(run_dir / "job.json") or {}
    total = job.get("algorithm", {}).get("num_steps")
    header: dict[str, Any] = {"name": job.get("name", run_dir.name), "total": total}
    if rows:
        last = rows[-1]
        steps = [r["time/step"] for r in rows if "time/step" in r]  # eval-only rows: none
        header |= {"step": int(last["step"]), "reward": last.get("reward")}
        header["step_s"] = last.get("time/step")
        if total and steps:  # no ETA before a trained step (eval.before_training's row)
            header["eta_s"] = sum(steps) / len(steps) * max(total - int(last["step"]), 0)
    end = read_end_record(run_dir)
    header["state"] = end["state"] if end else "running"
    error = end["reason"] if end and end["state"] == "failed" else None
    failed = [op for op in _json_lines(run_dir / "scaling.jsonl") if op.get("state") == "failed"]
    if error is None and failed:
        op = failed[-1]
        error = f"{op['role']} {op['operation']} to {op['target']} failed: {op.get('error', '')}"
    return header, error


def _admin_rows(admin: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per engine: the replicas of an elastic role (reserved ones too), else its
    engines (lost ones marked)."""
    if "replicas" in admin:
        return [_with_load(dict(r)) for r in admin["replicas"]]
    return [
        _with_load({"engine_id": e["engine_id"], "url": e["url"], "state": "serving"})
        for e in admin["engines"]
    ]


def _discovery_rows(discovery: Any) -> list[dict[str, Any]]:
    if not isinstance(discovery, dict):
        return []
    return [
        _with_load({"engine_id": e["engine_id"], "url": e["base_url"], "state": e["state"]})
        for model in discovery.get("models", {}).values()
        for e in model.get("engines", [])
    ]


def _with_load(row: dict[str, Any]) -> dict[str, Any]:
    """The engine's own load and weight version, when it is up."""
    url = row.get("url")
    if not url or row.get("state") == "reserved":
        return row
    load = engine_load(url, TIMEOUT_S)
    if load is not None:
        row |= {"queued": load.queued, "running": load.running, "tokens_per_s": load.tokens_per_s}
    info = _get(f"{url}/model_info")
    if isinstance(info, dict):
        row["weight_version"] = info.get("weight_version")
    return row


def render(frame: Frame) -> Group:
    """The view of one frame."""
    h = frame.header
    title = Text(f"relax-launch top  {h.get('name', '')}  ", style="bold")
    if "step" in h:
        title.append(f"step {h['step']}/{h.get('total') or '?'}  ")
        if h.get("reward") is not None:
            title.append(f"reward {h['reward']:.3f}  ")
        if h.get("eta_s") is not None:
            eta = int(h["eta_s"])
            title.append(f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}  ")
    title.append(f"[{h.get('state', 'running')}]", style="green")
    parts: list[Any] = [title, Text(f"gateway {frame.gateway or '-'}   run {frame.run_dir}")]
    for role, info in frame.roles.items():
        parts.append(_engine_table(role, info["engines"]))
    for op in frame.operations:
        states = ", ".join(f"{r['engine_id']} {r['state']}" for r in op.get("replicas", []))
        parts.append(
            Text(
                f"{op['role']} {op['operation']} {op['from']} -> {op['target']} "
                f"({op['source']}, {time.time() - op['started_at']:.0f} s): {states}",
                style="yellow",
            )
        )
    if frame.error:
        parts.append(Panel(frame.error, title="last error", style="red"))
    return Group(*parts)


def _engine_table(role: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=role, title_justify="left", expand=False)
    columns = ("engine", "state", "queued", "running", "tok/s", "version", "answered", "url")
    for column in columns:
        table.add_column(column, justify="right" if column not in ("engine", "url") else "left")
    for row in rows:
        table.add_row(
            row.get("engine_id", "?"),
            row.get("state", "?"),
            _number(row.get("queued")),
            _number(row.get("running")),
            _number(row.get("tokens_per_s")),
            str(row.get("weight_version") or "-"),
            _number(row.get("answered")),
            row.get("url") or "-",
        )
    return table


def top(target: str, *, interval_s: float, once: bool, token_env: str, console: Console) -> None:
    """Show ``target``'s view: once, or live until Ctrl-C or the job's end."""
    run_dir, gateway = locate(target)
    token = os.environ.get(token_env)
    if once:
        console.print(render(read_frame(run_dir, gateway, token)))
        return
    with Live(console=console, refresh_per_second=4, screen=False) as live:
        while True:
            frame = read_frame(run_dir, gateway, token)
            live.update(render(frame))
            if frame.header.get("state", "running") != "running":
                return
            time.sleep(interval_s)


def _number(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if isinstance(value, float) else str(value)


def _get(url: str, headers: dict[str, str] | None = None) -> Any:
    try:
        reply = http.call("GET", url, timeout_s=TIMEOUT_S, headers=headers)
        return reply.json() if reply.ok else None
    except (http.TransportError, TimeoutError, ValueError, OSError):
        return None


def _json_lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
