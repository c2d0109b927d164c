"""The sbatch script of a job: one ``srun`` task per node, each running one torchrun agent.

``relax-launch sbatch CONFIG`` renders it from the config and its plan and submits it; the
scripts in ``slurm/`` are renderings of the example configs, to read or adapt by hand. What the
script does, and why:

- torchrun's static rendezvous (``--master-addr`` = the first node, ``--node-rank`` =
  ``$SLURM_NODEID``): node k of the plan is the allocation's node k. (The c10d rendezvous orders
  nodes by address, so the trainer's node could land anywhere.) The port comes from the job id.
- ``srun --kill-on-bad-exit=1``: a node whose agent fails takes the others down with it.
- Every run writes into its own directory, ``{logging.dir}/job-$SLURM_JOB_ID`` (rank logs,
  metrics, ``torchrun-node<N>.log``); rank 0's console goes to ``slurm-<id>.out`` beside it.
- ``--signal=B:USR1@N``: N s before the time limit Slurm signals the batch shell, which
  writes the run's ``STOP`` file; rank 0 then finishes the train step or sync in flight,
  checkpoints and stops the job (exit 75). N is ``cluster.stop_lead_s``; ``auto`` measures
  those two in the newest ``metrics.jsonl`` under ``logging.dir`` (``stop_lead``). With
  ``--requeue`` the script then requeues the job, and ``checkpoint.resume=true`` (always passed)
  makes the requeued job continue from that checkpoint (with ``checkpoint.dir`` unset, from the
  run directory's, which a requeued job keeps: its id does not change).
- The job's exit code is the training job's: srun's, the highest of the agents' (an agent whose
  rank 0 stopped on request exits 75, read from the run's end record; torchrun says 1 for any
  rank's failure). ``--exclusive``: the ranks use every core and device of their node.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from relax_launch.config import load_config
from relax_launch.config.errors import ConfigError
from relax_launch.config.job import JobConfig
from relax_launch.placement import plan as place
from relax_launch.placement.plan import PlacementPlan
from relax_launch.placement.render import summary

# cluster.stop_lead_s=auto: Slurm's warning comes STOP_MARGIN x (step in flight + checkpoint
# write) + STOP_FIXED_S (the stop's notice and the shutdown) early, at least MIN_LEAD_S; a job
# with no checkpoint measured yet gets NEW_JOB_LEAD_S (a GPU job's optimizer state is GBs).
STOP_MARGIN, STOP_FIXED_S, MIN_LEAD_S = 1.5, 30.0, 120
NEW_JOB_LEAD_S = {"cpu": 120, "cuda": 600}
# what a stop lets finish (docs/operations.md): the train step, the sync, colocated moves
IN_FLIGHT_KEYS = ("time/train", "time/sync")
MOVE_PREFIXES = ("time/onload_", "time/offload_")
PORT_BASE = 20000  # + job id % 20000: the rendezvous port, the same on every node of a job


@dataclass(frozen=True)
class SbatchOptions:
    """What ``relax-launch sbatch`` passes on to Slurm (None: the cluster's default)."""

    partition: str | None = None
    time: str | None = None
    account: str | None = None
    gpus_per_node: int | None = None
    requeue: bool = False


@dataclass(frozen=True)
class StopLead:
    """How early Slurm's time-limit warning comes, and how that was decided."""

    seconds: int
    why: str


def stop_lead(job: JobConfig, metrics: Path | None) -> StopLead:
    """``cluster.stop_lead_s``, or for ``auto`` the lead ``metrics`` (an earlier run's
    metrics.jsonl, None for none) calls for: its longest step in flight and checkpoint write."""
    stated = job.cluster.stop_lead_s
    if stated != "auto":
        return StopLead(math.ceil(stated), "cluster.stop_lead_s")
    rows = _rows(metrics) if metrics is not None else []
    written = [r["time/checkpoint"] for r in rows if "time/checkpoint" in r]
    if not written:
        seconds = NEW_JOB_LEAD_S.get(job.cluster.device, MIN_LEAD_S)
        return StopLead(seconds, f"no checkpoint write measured yet ({job.cluster.device} job)")
    in_flight = max(
        sum(v for k, v in r.items() if k in IN_FLIGHT_KEYS or k.startswith(MOVE_PREFIXES))
        for r in rows
    )
    seconds = max(MIN_LEAD_S, math.ceil(STOP_MARGIN * (in_flight + max(written)) + STOP_FIXED_S))
    return StopLead(
        seconds,
        f"{STOP_MARGIN} x (step in flight {in_flight:.0f} s + checkpoint {max(written):.0f} s) "
        f"+ {STOP_FIXED_S:.0f} s, measured in {metrics}",
    )


def newest_metrics(log_root: Path) -> Path | None:
    """The newest metrics.jsonl of the job's earlier runs: ``relax-launch run``'s in
    ``log_root``, each sbatch run's in ``log_root/job-<id>``."""
    candidates = [log_root / "metrics.jsonl", *log_root.glob("job-*/metrics.jsonl")]
    found = [p for p in candidates if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def _rows(metrics: Path) -> list[dict[str, float]]:
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a killed job
    return [r for r in rows if isinstance(r, dict)]


def render(
    job: JobConfig,
    plan: PlacementPlan,
    config_path: str,
    overrides: tuple[str, ...],
    options: SbatchOptions,
    python: str = sys.executable,
    lead: StopLead | None = None,
) -> str:
    """The sbatch script of ``job`` placed as ``plan`` (see the module docstring); its agents
    run ``python`` (default: this interpreter, i.e. the environment relax-launch runs in).
    ``lead``: Slurm's warning before the time limit (default: ``stop_lead`` from the job's
    newest earlier run)."""
    log_root = Path(job.log_dir)
    lead = lead or stop_lead(job, newest_metrics(log_root))
    args = [config_path, *overrides, "logging.dir=$RELAX_RUN_DIR"]
    if not any(o.startswith("checkpoint.resume=") for o in overrides):
        args.append("checkpoint.resume=true")  # a requeued or resubmitted job continues
    lines = [
        "#!/bin/bash",
        f"# relax-launch job {job.name!r}: relax-launch sbatch {_quote([config_path, *overrides])}",
        *(f"# {line}" for line in summary(plan).splitlines()),
        f"#SBATCH --job-name=relax-{job.name}",
        f"#SBATCH --nodes={plan.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"#SBATCH --output={log_root}/slurm-%j.out",
        f"# stop lead {lead.seconds} s: {lead.why}",
        f"#SBATCH --signal=B:USR1@{lead.seconds}",
        *_optional_directives(options),
        "",
        *_body(plan, args, options, log_root, python, _supervised(job)),
    ]
    return "\n".join(lines) + "\n"


def check_gpus(job: JobConfig, gpus_per_node: int | None) -> None:
    """``--gpus-per-node`` must cover the plan's ranks per node, on a cuda job."""
    if gpus_per_node is None:
        return
    if job.cluster.device != "cuda":
        raise ConfigError(
            f"--gpus-per-node is for cuda jobs; this one runs on cluster.device="
            f"{job.cluster.device}: drop the option",
            ("cluster.device",),
        )
    if gpus_per_node < job.cluster.nproc_per_node:
        raise ConfigError(
            f"the plan puts cluster.nproc_per_node={job.cluster.nproc_per_node} ranks on each "
            f"node, one per GPU, but --gpus-per-node={gpus_per_node}: request "
            f"{job.cluster.nproc_per_node} GPUs or lower cluster.nproc_per_node",
            ("cluster.nproc_per_node",),
        )


def _optional_directives(options: SbatchOptions) -> list[str]:
    directives = []
    for flag, value in (
        ("partition", options.partition),
        ("time", options.time),
        ("account", options.account),
        ("gpus-per-node", options.gpus_per_node),
    ):
        if value is not None:
            directives.append(f"#SBATCH --{flag}={value}")
    if options.requeue:
        directives.append("#SBATCH --requeue")
    return directives


def _supervised(job: JobConfig) -> bool:
    """Whether the script asks ``commands/supervise.py`` after each srun: to restart a failed
    job (``cluster.max_restarts``) and to tell ``logging.notify`` how it ended."""
    return bool(job.cluster.max_restarts or job.logging.notify)


def _body(
    plan: PlacementPlan,
    args: list[str],
    options: SbatchOptions,
    log_root: Path,
    python: str,
    supervised: bool = False,
) -> list[str]:
    # Runs inside each srun task, where $SLURM_NODEID is the task's own node.
    agent = [
        "agent() {  # this node's torchrun agent; what it returns is this node's exit code",
        f"  {shlex.quote(python)} -m torch.distributed.run \\",
        f'    --nnodes {plan.nnodes} --node-rank "$SLURM_NODEID" '
        f"--nproc-per-node {plan.nproc_per_node} \\",
        '    --master-addr "$RELAX_HEAD" --master-port "$RELAX_PORT" \\',
        f"    --module relax_launch.launch {' '.join(_arg(a) for a in args)} \\",
        '    2> "$RELAX_RUN_DIR/torchrun-node$SLURM_NODEID.log"',
        "  local code=$?",
        "  # torchrun says 1 for any rank's failure: rank 0's end record tells a stop (75) apart",
        '  grep -qs \'"state": "stopped"\' "$RELAX_RUN_DIR/end.json" && code=75',
        "  return $code",
        "}",
        "export -f agent",
    ]
    return [
        "set -uo pipefail",
        'cd "$SLURM_SUBMIT_DIR"  # where the config\'s relative paths start',
        f'export RELAX_RUN_DIR="{log_root}/job-$SLURM_JOB_ID"',
        'mkdir -p "$RELAX_RUN_DIR"',
        'rm -f "$RELAX_RUN_DIR/STOP"  # a requeued job\'s run directory: its last stop is done',
        'export RELAX_JOB_STARTED="$(date +%s.%N)"',
        'export RELAX_HEAD="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
        f'export RELAX_PORT="$(( {PORT_BASE} + SLURM_JOB_ID % 20000 ))"',
        "# Slurm's warning before the time limit reaches this shell: rank 0 checkpoints and stops.",
        'trap \'echo "relax-launch: time limit near: stopping after a checkpoint"; '
        'echo "SIGUSR1 (Slurm: time limit near)" > "$RELAX_RUN_DIR/STOP"\' USR1',
        "# In a container, wrap the agent: srun --container-image=IMAGE ... (pyxis/enroot), with",
        "# the repository, model cache and checkpoint directory mounted at the same paths.",
        *agent,
        *(_supervised_srun(args, python) if supervised else _SRUN),
        *(
            [
                'if [ "$code" -eq 75 ]; then',
                '  echo "relax-launch: requeueing job $SLURM_JOB_ID to resume"',
                '  scontrol requeue "$SLURM_JOB_ID"',
                "fi",
            ]
            if options.requeue
            else []
        ),
        'exit "$code"',
    ]


_SRUN = [
    "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c agent &",
    "srun_pid=$!",
    "# a trapped signal interrupts wait: wait again until srun has really ended",
    'while wait "$srun_pid"; code=$?; kill -0 "$srun_pid" 2>/dev/null; do :; done',
]


def _supervised_srun(args: list[str], python: str) -> list[str]:
    """srun, then ``commands/supervise.py``: it tells logging.notify how the job ended and, for
    a failure cluster.max_restarts allows, exits 0 to run srun again (the job resumes from its
    newest checkpoint: checkpoint.resume=true)."""
    decide = f"{shlex.quote(python)} -m relax_launch.commands.supervise"
    return [
        "while :; do",
        *(f"  {line}" for line in _SRUN),
        f'  {decide} "$code" {" ".join(_arg(a) for a in args)} || break',
        '  export RELAX_JOB_STARTED="$(date +%s.%N)"  # the restarted job\'s STOP files',
        "done",
    ]


def _arg(arg: str) -> str:
    """Quoted for the agent's shell; the run directory's variable stays expandable."""
    return f'"{arg}"' if "$RELAX_RUN_DIR" in arg else shlex.quote(arg)


def _quote(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def submit(script: str, log_root: Path) -> str:
    """Write ``script`` beside the job's output and submit it; returns the Slurm job id."""
    log_root.mkdir(parents=True, exist_ok=True)  # Slurm opens --output in it, creating nothing
    path = log_root / "relax-launch.sbatch"
    path.write_text(script)
    result = subprocess.run(
        ["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60
    )
    if result.returncode != 0:
        raise RuntimeError(f"sbatch {path} failed: {result.stderr.strip() or result.stdout}")
    return result.stdout.strip().split(";")[0]


# The scripts in slurm/: (config, the options relax-launch sbatch is given, script name).
EXAMPLES = (
    ("configs/quickstart_cpu.yaml", SbatchOptions(time="01:00:00"), "one_node_cpu.sbatch"),
    (
        "configs/qwen3_8b_decoupled_2x8.yaml",
        SbatchOptions(time="04:00:00", gpus_per_node=8, requeue=True),
        "two_nodes_gpu.sbatch",
    ),
)


def render_examples() -> dict[str, str]:
    """The scripts of slurm/, by file name, as ``relax-launch sbatch --dry-run`` renders them
    (agents run ``python``: the environment the job is submitted from)."""
    scripts = {}
    for config_path, options, name in EXAMPLES:
        job = load_config(config_path, ())
        lead = stop_lead(job, None)  # not this checkout's runs: the same script everywhere
        scripts[name] = render(job, place(job), config_path, (), options, "python", lead)
    return scripts


if __name__ == "__main__":  # python -m relax_launch.commands.sbatch: rewrite slurm/*.sbatch
    for name, script in render_examples().items():
        Path("slurm", name).write_text(script)
