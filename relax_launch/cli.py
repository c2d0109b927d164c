"""The ``relax-launch`` command line. Thin: each command calls library functions.

Imports stay light (no torch, SGLang, Megatron or web stack) so ``--help`` and ``plan`` answer
in well under a second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from relax_launch import __version__, platform
from relax_launch.commands.sbatch import SbatchOptions, check_gpus, render, submit
from relax_launch.config import ConfigError, JobConfig, load_config
from relax_launch.models.registry import is_vision_language
from relax_launch.placement import PlacementPlan, check_runnable, plan, preflight
from relax_launch.placement.memory_plan import MemoryPlan, memory_plan
from relax_launch.placement.render import memory_table, summary, table, write_picture
from relax_launch.rl.inputs import read_inputs
from relax_launch.run_dir import STOP_FILE


def _load_and_plan(
    config_path: str,
    overrides: tuple[str, ...],
    nnodes: int | None,
    nproc: int | None,
    require_models: bool = False,
) -> tuple[JobConfig, PlacementPlan, list[str]]:
    job = load_config(config_path, overrides)
    placement = plan(job, nnodes=nnodes, nproc_per_node=nproc)
    notes = preflight(job, placement, require_models=require_models)
    if require_models:  # about to start it
        check_runnable(job, placement)
        r, vision = job.rollout, is_vision_language(job.trainer.model)
        # images: headers here; rank 0 decodes each once before any engine or trainer starts
        read_inputs(
            job.data, job.reward, job.eval, r.function, r.environment, vision=vision, decode=False
        )
    return job, placement, notes


def _fail(message: str) -> None:
    click.echo(f"relax-launch: {message}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="relax-launch")
def main() -> None:
    """RL post-training of LLMs (GRPO, on-policy distillation, GenRM) as one torchrun job."""


def critic_line(job: JobConfig, placement: PlacementPlan, memory: MemoryPlan | None) -> str:
    """Where PPO's value model lives: on ranks of its own, or on the trainer's ranks in the
    trainer's layout, and in a colocated placement where its state is in the trainer's turn
    (``runtime/critic_turns.py``)."""
    t, model = placement.trainer, job.critic.model or job.trainer.model
    if placement.critic is not None:  # critic.ranks=own
        c = placement.critic
        return (
            f"critic: value model of {model} on ranks of its own {c.ranks[0]}-{c.ranks[-1]} "
            f"(tp={c.tp_size} dp={c.dp_size}), trained while the policy trains"
        )
    line = (
        f"critic: value model of {model} on the trainer ranks {t.ranks[0]}-{t.ranks[-1]} "
        f"(tp={t.tp_size} pp={t.pp_size} dp={t.dp_size}), trained after the policy each step"
    )
    if placement.mode == "decoupled":
        return line
    # the memory plan resolves auto; without one (a model's size unknown) the job swaps
    mode = memory.critic_mode if memory is not None else "swap"
    within = {
        "keep": "beside the policy's state through the turn",
        "swap": "swapped with the policy's gradients and optimizer state",
    }[mode]
    chosen = "memory plan" if job.critic.offload == "auto" else "config"
    return (
        f"{line}; in host memory outside the trainer's turn, {within} "
        f"(critic.offload={mode}, by the {chosen})"
    )


@main.command("plan")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option(
    "--nnodes", type=click.IntRange(min=1), help="Plan for N nodes (default: cluster.nnodes)."
)
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    help="Ranks per node (default: cluster.nproc_per_node).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON instead of a table.")
@click.option(
    "--picture", type=click.Path(dir_okay=False), help="Also draw the plan to FILE.svg or FILE.png."
)
def plan_command(
    config_path: str,
    overrides: tuple[str, ...],
    nnodes: int | None,
    nproc_per_node: int | None,
    as_json: bool,
    picture: str | None,
) -> None:
    """Validate CONFIG and print its rank map: rank, node, roles, engine, phase.

    Exits 2 with the reason on stderr when the config or its placement is rejected.
    """
    try:
        job, placement, warnings = _load_and_plan(config_path, overrides, nnodes, nproc_per_node)
        if picture:
            click.echo(f"picture: {write_picture(placement, picture)}", err=True)
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
    memory = memory_plan(job, placement)
    if as_json:
        data = json.loads(placement.to_json())
        click.echo(json.dumps(data | {"memory": memory and json.loads(memory.to_json())}))
    else:
        click.echo(table(placement) + (f"\n{memory_table(memory)}" if memory else ""))
        if job.critic is not None:
            click.echo(critic_line(job, placement, memory))
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)


@main.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue from the newest checkpoint in checkpoint.dir (checkpoint.resume=true).",
)
def run_command(config_path: str, overrides: tuple[str, ...], resume: bool) -> None:
    """Validate CONFIG, then run it on this machine as one torchrun job (relax_launch/launch.py).

    Exits with the job's code; on failure names the rank and role that failed.
    """
    if resume:
        overrides = (*overrides, "checkpoint.resume=true")
    try:
        job, placement, notes = _load_and_plan(
            config_path, overrides, None, None, require_models=True
        )
    except ConfigError as exc:
        _fail(str(exc))
    if placement.nnodes != 1:
        _fail(
            f"run starts one machine; cluster.nnodes={placement.nnodes} needs a launcher per node"
        )
    from relax_launch.commands.launcher import ENTRY_MODULE, run_local

    _announce(job, placement, notes)
    sys.exit(run_local(ENTRY_MODULE, [config_path, *overrides], placement, job))


def _announce(job: JobConfig, placement: PlacementPlan, notes: list[str]) -> None:
    """What the operator reads before the job starts: the plan, precision, where logs go."""
    click.echo(summary(placement))
    engines = "".join(f", {role} {job.engine_dtype(role)}" for role in job.inference_roles())
    line = f"precision: trainer {job.trainer.dtype}{engines}"
    if job.cluster.device == "cpu":  # each process's share of the node's cores
        cores, overlap = platform.node_cores(), job.rollout_overlaps_training
        roles = ["trainer", *job.inference_roles()]
        threads = ", ".join(f"{r} {placement.cpu_threads(0, r, cores, overlap)}" for r in roles)
        line += f"; threads per process ({cores} cores): {threads}"
    click.echo(line)
    if (lora := job.trainer.lora) is not None:
        held = {"merged": "merged weights", "adapter": "the adapter"}[lora.engines]
        click.echo(
            f"LoRA: rank {lora.rank}, scale {lora.scale:g}, on {', '.join(lora.target_modules)};"
            f" the rollout engines hold {held}"
        )
    memory = memory_plan(job, placement)
    if memory is not None:
        fullest = max(memory.devices, key=lambda d: d.total)
        click.echo(
            f"memory: fullest device rank {fullest.rank}, {fullest.total / 1e9:.1f} of "
            f"{memory.capacity / 1e9:.1f} GB in phase '{fullest.phase}' (every device: "
            f"relax-launch plan; {job.log_dir}/memory_plan.json)"
        )
    for note in notes:
        click.echo(f"note: {note}")
    click.echo(f"logs: {job.log_dir}/ (rank<R>.log per rank, <role>-engine<N>.log per engine)")


@main.command("config")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def config_command(config_path: str, overrides: tuple[str, ...]) -> None:
    """Validate CONFIG and print it in full, defaults included, as JSON."""
    try:
        job = load_config(config_path, overrides)
    except ConfigError as exc:
        _fail(str(exc))
    click.echo(json.dumps(job.model_dump(mode="json"), indent=2))


@main.command("sbatch", context_settings={"ignore_unknown_options": True})
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--partition", help="Slurm partition (default: the cluster's).")
@click.option("--time", help="Time limit, e.g. 04:00:00 (default: the partition's).")
@click.option("--account", help="Slurm account to charge.")
@click.option(
    "--nodes", type=click.IntRange(min=1), help="Nodes to run on (default: cluster.nnodes)."
)
@click.option(
    "--gpus-per-node",
    type=click.IntRange(min=1),
    help="GPUs to request per node; must cover cluster.nproc_per_node (cuda jobs only).",
)
@click.option("--requeue", is_flag=True, help="Requeue the job after it stops for its time limit.")
@click.option("--dry-run", is_flag=True, help="Print the script instead of submitting it.")
def sbatch_command(
    config_path: str, overrides: tuple[str, ...], nodes: int | None, dry_run: bool, **slurm: Any
) -> None:
    """Validate CONFIG, render its sbatch script (one torchrun agent per node) and submit it.

    Refuses, before submitting, a config that is invalid or whose plan does not fit the nodes
    asked for. Prints the Slurm job id and where its output goes.
    """
    overrides = (*overrides, f"cluster.nnodes={nodes}") if nodes else overrides
    try:
        job, placement, _ = _load_and_plan(
            config_path, overrides, None, None, require_models=not dry_run
        )
        options = SbatchOptions(**slurm)
        check_gpus(job, options.gpus_per_node)
        script = render(job, placement, config_path, overrides, options)
        if dry_run:
            return click.echo(script, nl=False)
        job_id = submit(script, job.log_dir)
    except (ConfigError, ValueError, RuntimeError, OSError) as exc:
        _fail(str(exc))
    click.echo(f"submitted job {job_id}: {placement.nnodes} node(s) x {placement.nproc_per_node}")
    click.echo(f"console: {job.log_dir}/slurm-{job_id}.out; run: {job.log_dir}/job-{job_id}/")
    click.echo(f"follow it with: relax-launch status {job_id}")


@main.command("status")
@click.argument("run", metavar="RUN_DIR|JOB_ID")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status_command(run: str, as_json: bool) -> None:
    """Where a job is: its state, last step, gateway address and engines (from the run
    directory, the live gateway, and Slurm for a job id)."""
    from relax_launch.commands.status import job_status, render_status

    try:
        status = job_status(run)
    except (FileNotFoundError, RuntimeError) as exc:
        _fail(str(exc))
    click.echo(json.dumps(status, indent=2) if as_json else render_status(status))


@main.command("top")
@click.argument("target", metavar="RUN_DIR|URL")
@click.option(
    "--interval", type=click.FloatRange(min=0.2), default=2.0, help="Seconds between readings."
)
@click.option("--once", is_flag=True, help="Print one reading and exit (no live view).")
@click.option(
    "--token-env",
    default="RELAX_ADMIN_TOKEN",
    help="Environment variable with the gateway's admin token (reserved engines, operations).",
)
def top_command(target: str, interval: float, once: bool, token_env: str) -> None:
    """A live view of a running job: step, reward, ETA; each engine's state, queue, tokens/s
    and weight version; scale operations in flight; the last error. Ctrl-C leaves."""
    from rich.console import Console

    from relax_launch.commands.top import top

    try:
        top(target, interval_s=interval, once=once, token_env=token_env, console=Console())
    except FileNotFoundError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        pass


@main.command("stop")
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(file_okay=False, exists=True))
def stop_command(run_dir: str) -> None:
    """Ask the job writing RUN_DIR to stop after a checkpoint (it exits 75; resume it with
    --resume)."""
    (Path(run_dir) / STOP_FILE).touch()
    click.echo(f"relax-launch: asked the job in {run_dir} to stop after a checkpoint")


@main.command("export")
@click.argument("source", metavar="RUN_DIR|CHECKPOINT", type=click.Path(exists=True))
@click.option(
    "--out", required=True, type=click.Path(), help="The new directory to write (must be empty)."
)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp32"]),
    help="Dtype of the written weights (default: the trainer's).",
)
@click.option(
    "--merge-lora",
    is_flag=True,
    help="LoRA checkpoints: write the merged full model instead of the PEFT adapter.",
)
def export_command(source: str, out: str, dtype: str | None, merge_lora: bool) -> None:
    """Write a checkpoint (or a run directory's newest) as a Hugging Face model directory; a
    LoRA run's as a PEFT adapter unless --merge-lora."""
    from pathlib import Path

    from relax_launch.commands.export import ExportError, export_checkpoint

    names = {"bf16": "bfloat16", "fp32": "float32", None: None}
    try:
        written = export_checkpoint(Path(source), Path(out), names[dtype], merge_lora)
    except (ExportError, FileNotFoundError) as exc:
        _fail(str(exc))
    click.echo(f"relax-launch: wrote {written}")
