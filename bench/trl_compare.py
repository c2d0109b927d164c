"""Benchmark: the CPU quickstart's GRPO job with relax-launch and with TRL's GRPOTrainer.

Runs, one after the other on this machine, the job of ``configs/quickstart_cpu.yaml`` without
its teacher (``teacher=null algorithm.distill_coef=0 cluster.nproc_per_node=3``: trainer DP=2
on ranks 0-1, one SGLang rollout engine on rank 2), on-policy (``algorithm.off_policy_steps=0``)
and one-step off-policy (``=1``), then the same job with TRL's ``GRPOTrainer`` (on-policy, one
process, generation with transformers' ``generate``), and prints ours ÷ TRL for:

- median step time, of every step (ours: ``time/step`` in metrics.jsonl; TRL: between
  ``on_step_end`` callbacks, the first from ``on_train_begin``);
- time to first step, from launching the command to the end of the first optimizer step (ours:
  metrics.jsonl's first line appearing, polled every 50 ms; TRL: its first ``on_step_end``);
- total time, from launching the command to its exit (both export the final policy in Hugging
  Face format: ours by default, TRL by ``trainer.save_model``).

TRL gets what the loaded config says: the same model directory, prompts in the same order, the
project's own reward functions (from this source tree), group size, micro-batch, max response
tokens, lr (constant), temperature, clip range, KL coefficient, gradient clip, seed and fp32.
"others' CPU" is the cores that processes other than the run's kept busy meanwhile (noise).
TRL runs in a virtualenv of its own, ``$RELAX_LAUNCH_CACHE/trl-venv`` (``~/.cache/relax-launch``),
made once with ``trl==TRL_VERSION`` under the project's pins and its CPU torch build (pip finds
``torch==X+cpu`` where the project's bootstrap does; elsewhere set ``PIP_EXTRA_INDEX_URL``).

Run: ``.venv/bin/python bench/trl_compare.py [--steps N] [--json PATH] [--skip-ours]
[--skip-trl]``. The same file is TRL's side too, run by that venv's Python with ``--trl-worker``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "quickstart_cpu.yaml"
NO_TEACHER = ("teacher=null", "algorithm.distill_coef=0", "cluster.nproc_per_node=3")
TRL_VERSION = "1.16.0"
PINS = ROOT / "requirements" / "pins.txt"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass
class Run:
    """One side's figures, in seconds from launching its command."""

    label: str
    step_s: list[float]
    first_step_s: float
    total_s: float
    reward: float  # mean over the steps: a sanity check that both learn the same task
    response_tokens: float
    others_cores: float  # cores that other processes kept busy meanwhile (noise; of 2 here)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)


# ---- our side ------------------------------------------------------------------------------


def run_ours(steps: int, off_policy: int, work: Path) -> Run:
    """``relax-launch run`` of the quickstart without its teacher; its figures."""
    logs = work / f"ours-off{off_policy}"
    logs.mkdir()
    overrides = [*NO_TEACHER, f"algorithm.num_steps={steps}"]
    overrides += [f"algorithm.off_policy_steps={off_policy}", f"logging.dir={logs}"]
    label = "ours off-policy" if off_policy else "ours on-policy"
    command = [str(Path(sys.executable).with_name("relax-launch")), "run", str(CONFIG), *overrides]
    run = launch(command, logs / "console.log", label, dict(os.environ), logs / "metrics.jsonl")
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    return Run(
        label=label,
        step_s=[r["time/step"] for r in rows],
        first_step_s=run.first - run.launched,
        total_s=run.ended - run.launched,
        reward=statistics.mean(r["reward"] for r in rows),
        response_tokens=statistics.mean(r["response_tokens"] for r in rows),
        others_cores=run.others_cores,
    )


@dataclass
class Launch:
    """One command's run, in time.time() seconds."""

    launched: float
    ended: float
    first: float  # when the watched file got its first line (ours: the first step's end)
    others_cores: float  # cores other processes than the command's kept busy meanwhile


def launch(cmd: list[str], log: Path, label: str, env: dict, watch: Path | None = None) -> Launch:
    """Run ``cmd`` with its output in ``log``, watching the file ``watch`` and the CPU time of
    the command's process tree; exits with the log's tail when the command fails."""
    import psutil

    print(f"{label}: running (log: {log})", flush=True)
    seen: dict[int, float] = {}  # CPU seconds of each process of the tree, last seen
    with log.open("w") as out:
        busy, launched, first = busy_seconds(), time.time(), 0.0
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        root, polls = psutil.Process(job.pid), 0
        while job.poll() is None:
            if watch and not first and watch.is_file() and watch.read_text():
                first = time.time()
            polls += 1
            if polls % 5 == 0:  # a quarter of a second
                poll_tree(root, seen)
            time.sleep(0.05)
    ended = time.time()
    if job.returncode != 0 or (watch and not first):
        fail(f"{label} failed (exit {job.returncode})", log)
    others = max(0.0, busy_seconds() - busy - sum(seen.values())) / (ended - launched)
    return Launch(launched, ended, first, others)


def poll_tree(root: Any, seen: dict[int, float]) -> None:
    """Record the CPU seconds so far of ``root`` and each of its descendants into ``seen``."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                seen[process.pid] = times.user + times.system


def busy_seconds() -> float:
    """Core-seconds this machine has spent busy (not idle or waiting on I/O) since boot."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def fail(message: str, log: Path) -> None:
    tail = log.read_text(errors="replace").splitlines()[-40:]
    raise SystemExit("\n".join([message, *(f"  | {line}" for line in tail)]))


# ---- TRL's side: the job as TRL's config, its venv, its run --------------------------------


def trl_spec(steps: int, work: Path) -> dict[str, Any]:
    """The job of our config as GRPOTrainer's inputs: model, prompts, rewards, GRPOConfig."""
    from relax_launch.config import load_config
    from relax_launch.models.build import ensure_model
    from relax_launch.rl.data import PromptStream, load_prompts

    job = load_config(CONFIG, [*NO_TEACHER, f"algorithm.num_steps={steps}"])
    trainer, algo, data = job.trainer, job.algorithm, job.data
    mirrored = (trainer.dtype, algo.advantage_estimator, algo.loss_aggregation, trainer.lora)
    if mirrored != ("float32", "grpo", "token", None) or algo.policy_ratio != "token":
        raise SystemExit(f"TRL's side mirrors fp32 GRPO with a token-mean loss only: {mirrored}")
    if any(source.function is None for source in job.reward.sources):
        raise SystemExit("TRL's side takes reward functions only (no GenRM judge)")
    stream = PromptStream(load_prompts(data), shuffle=data.shuffle, seed=data.seed)
    prompts = stream.next_batch(data.prompts_per_step * steps)  # our steps' prompts, in order
    batch = data.prompts_per_step * algo.n_samples_per_prompt
    return {
        "model": str(ensure_model(trainer.model)),
        "rows": [
            {"prompt": list(p.messages), "label": p.label, "data_source": p.data_source}
            for p in prompts
        ],
        "rewards": [[s.name, s.function, s.weight] for s in job.reward.sources],
        "grpo": {
            "max_steps": steps,
            "learning_rate": trainer.lr,
            "lr_scheduler_type": "constant",  # Megatron's optimizer here: no schedule
            "weight_decay": trainer.weight_decay,
            "max_grad_norm": trainer.clip_grad,
            "seed": trainer.seed,
            "per_device_train_batch_size": trainer.sequences_per_micro_batch,
            "gradient_accumulation_steps": batch // trainer.sequences_per_micro_batch,
            "num_generations": algo.n_samples_per_prompt,
            "temperature": algo.temperature,
            "max_completion_length": data.max_response_tokens,
            "epsilon": algo.clip_eps,
            "epsilon_high": algo.clip_eps_high or algo.clip_eps,
            "beta": algo.kl_coef,
            "output_dir": str(work / "trl-output"),
        },
        "record": str(work / "trl-record.json"),
    }


def trl_venv() -> Path:
    """TRL's virtualenv, made or brought up to date; its Python."""
    from relax_launch.models.registry import cache_dir

    venv = cache_dir() / "trl-venv"
    python = venv / "bin" / "python"
    torch = metadata.version("torch").split("+")[0] + "+cpu"  # the project's, CPU build only
    constraints = f"{PINS.read_text()}\ntorch=={torch}\n"
    # pydantic and apprise: what relax_launch.rl.rewards imports (through its config, which
    # checks logging.notify's URLs), for the rewards
    packages = [f"torch=={torch}", f"trl=={TRL_VERSION}", "pydantic", "apprise"]
    # the venv is remade when the pins or the packages change
    wanted = hashlib.sha256(f"{packages}\n{constraints}".encode()).hexdigest()
    stamp = venv / ".relax-launch-stamp"
    if python.is_file() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    log = venv.parent / "trl-venv-install.log"
    print(f"TRL: installing trl=={TRL_VERSION}, torch=={torch} into {venv} (log: {log})")
    venv.mkdir(parents=True, exist_ok=True)
    (venv / "constraints.txt").write_text(constraints)
    pip = [str(python), "-m", "pip", "install", "-c", str(venv / "constraints.txt")]
    install = [*pip, *packages]
    cpu_only = "import torch, trl; assert not torch.version.cuda, torch.__version__"
    commands = (["python3.11", "-m", "venv", str(venv)], install, [str(python), "-c", cpu_only])
    with log.open("w") as out:
        for command in commands:
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
                fail(f"TRL's venv: {' '.join(command)} failed", log)
    stamp.write_text(wanted)
    return python


def run_trl(steps: int, work: Path) -> Run:
    """GRPOTrainer on the same job, in TRL's venv; its figures."""
    python = trl_venv()
    spec = trl_spec(steps, work)
    spec_file = work / "trl-spec.json"
    spec_file.write_text(json.dumps(spec))
    command = [str(python), str(Path(__file__).resolve()), "--trl-worker", str(spec_file)]
    env = os.environ | OFFLINE | {"PYTHONPATH": str(ROOT)}  # the project's reward functions
    run = launch(command, work / "trl.log", f"TRL {TRL_VERSION}", env)
    record = json.loads(Path(spec["record"]).read_text())
    ends = record["step_end"]
    return Run(
        label=f"TRL {TRL_VERSION}",
        step_s=[b - a for a, b in zip([record["train_begin"], *ends], ends, strict=False)],
        first_step_s=ends[0] - run.launched,
        total_s=run.ended - run.launched,
        reward=statistics.mean(record["reward"]),
        response_tokens=statistics.mean(record["response_tokens"]),
        others_cores=run.others_cores,
    )


# ---- inside TRL's venv ---------------------------------------------------------------------


def trl_worker(spec_path: str) -> None:
    """Train with GRPOTrainer as ``spec`` says; write the step clock and per-step metrics."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    record: dict[str, Any] = {"train_begin": None, "step_end": []}
    config = GRPOConfig(
        **spec["grpo"],
        reward_weights=[weight for _, _, weight in spec["rewards"]],
        loss_type="dapo",  # token mean over the whole step's batch, as ours
        scale_rewards="group",
        shuffle_dataset=False,  # our order
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,  # ours recomputes no activations
        model_init_kwargs={"dtype": torch.float32},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=reward_functions(spec["rewards"], config.num_generations),
        args=config,
        train_dataset=Dataset.from_list(spec["rows"]),
        callbacks=[step_clock(record)],
    )
    trainer.train()
    trainer.save_model(spec["grpo"]["output_dir"])  # ours exports the final policy too
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    record["reward"] = [entry["reward"] for entry in logs]
    record["response_tokens"] = [entry["completions/mean_length"] for entry in logs]
    Path(spec["record"]).write_text(json.dumps(record))


def step_clock(record: dict[str, Any]) -> Any:
    """A TrainerCallback writing time.time() at the start of training and each step's end."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record["train_begin"] = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record["step_end"].append(time.time())

    return StepClock()


def reward_functions(sources: list[list[Any]], group_size: int) -> list[Any]:
    """The project's reward functions (``builtin:NAME`` or ``module:function``) as TRL's: each
    completion becomes a Sample with its text and label, as our rollout hands them over."""
    import asyncio
    import inspect

    from relax_launch.rl.rewards import load_function
    from relax_launch.rl.samples import Sample

    unused: dict[str, Any] = dict(prompt_ids=[], response_ids=[], logprobs=[], weight_version="")

    def wrap(name: str, function: Any) -> Any:
        def reward(prompts: list, completions: list, label: list, **kw: Any) -> list[float]:
            rows = zip(prompts, completions, label, kw["data_source"], strict=True)
            samples = [
                Sample(
                    **unused,
                    group=i // group_size,
                    question=prompt[-1]["content"],
                    label=answer,
                    text=completion[-1]["content"],
                    data_source=source,
                )
                for i, (prompt, completion, answer, source) in enumerate(rows)
            ]
            values = function(samples)
            return asyncio.run(values) if inspect.isawaitable(values) else values

        reward.__name__ = name
        return reward

    return [wrap(name, load_function(spec)) for name, spec, _ in sources]


# ---- report --------------------------------------------------------------------------------

ROWS = (
    ("median step (s)", "median_step_s"),
    ("time to first step (s)", "first_step_s"),
    ("total (s)", "total_s"),
    ("mean reward", "reward"),
    ("mean response tokens", "response_tokens"),
    ("others' CPU (cores)", "others_cores"),
)  # ours ÷ TRL for the times (*_s)


def report(runs: list[Run], trl: Run | None) -> dict[str, Any]:
    """Print the table (each side, and ours ÷ TRL for the times); the figures as a dict."""
    columns = [*runs, *([trl] if trl else [])]
    heads = [r.label for r in columns] + (
        [f"{r.label.removeprefix('ours ')} ÷ TRL" for r in runs] if trl else []
    )
    print("\n" + f"{'':<24}" + "".join(f"{h:>22}" for h in heads))
    runs_out = {r.label: asdict(r) | {"median_step_s": r.median_step_s} for r in columns}
    out: dict[str, Any] = {"trl_version": TRL_VERSION, "runs": runs_out, "ratios": {}}
    for title, attr in ROWS:
        values = [getattr(r, attr) for r in columns]
        if trl and attr.endswith("_s"):
            ratios = [getattr(r, attr) / getattr(trl, attr) for r in runs]
            for r, ratio in zip(runs, ratios, strict=True):
                out["ratios"].setdefault(r.label, {})[attr] = ratio
            values += ratios
        print(f"{title:<24}" + "".join(f"{v:>22.2f}" for v in values))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="RL steps of each run (12)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--skip-ours", action="store_true", help="run TRL's side only")
    parser.add_argument("--skip-trl", action="store_true", help="run our side only")
    parser.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return 0
    begun = time.time()
    with tempfile.TemporaryDirectory(prefix="trl-compare-") as directory:
        work = Path(directory)
        runs = [] if args.skip_ours else [run_ours(args.steps, off, work) for off in (0, 1)]
        trl = None if args.skip_trl else run_trl(args.steps, work)
    figures = report(runs, trl) | {"steps": args.steps, "config": str(CONFIG.relative_to(ROOT))}
    print(f"\n{args.steps} steps a run; the whole bench took {time.time() - begun:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
