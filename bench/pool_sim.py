"""The shared spare pool at cluster scale: step time of one pool of spare GPUs that the real
autoscaler (``relax_launch/runtime/pool_policy.py``) moves between rollout, teacher and judge,
against the best static split of the same GPUs and against per-role spares scaled by each
role's own autoscaler (``relax_launch/runtime/autoscale_policy.py``), on 64 and 512 GPUs, for
workloads whose teacher and judge shares change during the run. The model is
``bench/pool_model.py``.

    .venv/bin/python bench/pool_sim.py [--steps 30] [--start-scale 1.0]

Inputs (H100 SXM; every figure either published, derived from one, or marked assumed):

- rollout and judge engines: an 8B model (Llama-3.1-8B, bf16), TP 1. Saturated decode:
  16,215 output tokens/s per engine, SGLang, 1,000 ShareGPT prompts offline
  (research.aimultiple.com/inference-engines). One request alone: at most 3.35 TB/s (H100 SXM
  datasheet) / 16 GB of weights = 209 tokens/s; taken as 178 (85 %), so an engine makes half its
  peak at 90 requests in flight. 256 requests at once per engine (assumed).
- teacher engines: a 32B model, TP 2, scoring = prefill only: 2 GPUs x 989 TFLOP/s bf16 dense
  (datasheet) x 40 % utilisation (assumed) / 64 GFLOP a token = 12,362 tokens/s per engine.
- trainer: 6 x 8e9 FLOP a token at 989 TFLOP/s x 40 % on a quarter of the GPUs; the weight
  sync 2 s (16 GB at about 8 GB/s; assumed).
- start-up: an 8B engine 60 s, the 32B TP-2 teacher 120 s (SGLang's own reports: a boot of 1-2
  min, sgl-project/sglang#509; 3-6+ min for large models, sgl-project/sglang#27139); a rollout
  engine also waits for its first weight sync. On this repo's CPU machine a scale-out took 1.01 x
  a bare engine start (docs/benchmarks.md, Elastic replicas): a scale-out costs the engine's start.
- a step: 8 samples of each of 64 prompts per 8 inference GPUs, prompts of 512 tokens, responses
  of 2,048 tokens on average and 8,192 at most (its last request decodes alone at 178 tokens/s).

Setups, each on the same GPUs (a quarter to the trainer, the rest to inference):

- static: the best split for the whole run, chosen knowing every step (hindsight);
- per-role spares: the best static split of 75 % of the inference GPUs, and the other 25 %
  reserved per role in proportion to that split (``max_engines``), each role scaled by its own
  autoscaler (rollout: ``PhasePolicy``, target phase 60 s; teacher, judge: ``LoadPolicy``);
- shared pool: the same 75 % split, and the 25 % in one pool for ``PoolPolicy``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pool_model import INTERVAL_S, Cluster, RoleState, Scaler, StepWork, Work

from relax_launch.inference.config import AutoscaleConfig, RolloutAutoscaleConfig
from relax_launch.runtime.autoscale_policy import (
    Load,
    LoadPolicy,
    PhasePolicy,
    RolloutPhase,
    Scaling,
)
from relax_launch.runtime.pool_policy import PoolPolicy, PoolPolicyConfig, PoolView, RoleView

PEAK_8B, HALF_8B, SLOTS = 16_215.0, 90.0, 256
PEAK_TEACHER = 2 * 989e12 * 0.4 / 64e9
TRAIN_FLOPS_PER_GPU = 989e12 * 0.4
PROMPT, MEAN, LONGEST = 512, 2048, 8192
WIDTH = {"rollout": 1, "teacher": 2, "genrm": 1}
POOL_SHARE = 0.25
TARGET_QUEUE = 32  # the autoscalers aim at 32 requests an engine (an engine makes 26 % of its peak)


@dataclass(frozen=True)
class StepLoad:
    """What one step asks: samples, judge tokens per sample (0: no judge), teacher or not."""

    samples: int
    judge_tokens: int
    teacher: bool


WORKLOADS: dict[str, tuple[str, Callable[[int, int, int], StepLoad]]] = {
    "judge-grows": (
        "teacher every step; the judge's answer grows from 128 to 2,048 tokens",
        lambda s, n, samples: StepLoad(samples, int(128 + 1920 * s / max(n - 1, 1)), True),
    ),
    "teacher-fades": (
        "teacher in the first third only (distillation warm-up); a 512-token judge throughout",
        lambda s, n, samples: StepLoad(samples, 512, s < n // 3),
    ),
    "alternating": (
        "blocks of 5 steps: judged (1,024-token answers, no teacher), then distilled (no judge)",
        lambda s, n, samples: StepLoad(samples, 1024 * ((s // 5) % 2 == 0), (s // 5) % 2 == 1),
    ),
}


def step_work(load: StepLoad, train_gpus: int, start_scale: float) -> StepWork:
    decode = {"peak": PEAK_8B, "half": HALF_8B, "slots": SLOTS}
    alone = PEAK_8B / (1 + HALF_8B)
    rollout = Work(load.samples, MEAN, tail_s=(LONGEST - MEAN) / alone, **decode)
    genrm = None
    if load.judge_tokens:
        genrm = Work(load.samples, load.judge_tokens, tail_s=load.judge_tokens / alone, **decode)
    teacher = None
    if load.teacher:
        teacher = Work(load.samples, PROMPT + MEAN, PEAK_TEACHER, 0.5, 64, tail_s=1.0)
    tokens = load.samples * (PROMPT + MEAN)
    train_s = 6 * 8e9 * tokens / (train_gpus * TRAIN_FLOPS_PER_GPU)
    return StepWork(rollout, teacher, genrm, train_s, 2.0)


def phase_s(work: Work | None, n: int) -> float:
    """A phase's seconds on ``n`` engines throughout (the model's equation, solved)."""
    if work is None:
        return 0.0
    if n <= 0:
        return math.inf
    r0, full = work.requests, n * work.slots
    t = 0.0
    if r0 > full:
        t += (r0 - full) * work.length / work.rate(r0, n)
        r0 = full
    if r0 > n:
        t += work.length / work.peak * ((r0 - n) / n + work.half * math.log(r0 / n))
    return t + work.tail_s


def best_split(steps: list[StepWork], gpus: int, used: set[str]) -> dict[str, int]:
    """Engines per role minimising the run's time on ``gpus`` (every role used gets one)."""
    best, best_s = None, math.inf
    teachers = range(1 if "teacher" in used else 0, gpus // WIDTH["teacher"] + 1)
    for teacher in teachers:
        for genrm in range(1 if "genrm" in used else 0, gpus - 2 * teacher):
            rollout = gpus - 2 * teacher - genrm
            if rollout < 1:
                break
            total = sum(
                phase_s(s.rollout, rollout)
                + max(phase_s(s.teacher, teacher), phase_s(s.genrm, genrm))
                for s in steps
            )
            if total < best_s:
                best, best_s = {"rollout": rollout, "teacher": teacher, "genrm": genrm}, total
    assert best is not None
    return best


def roles_for(split: dict[str, int], start_scale: float) -> dict[str, RoleState]:
    start = {"rollout": 62.0, "teacher": 120.0, "genrm": 60.0}
    return {
        name: RoleState(name, WIDTH[name], start[name] * start_scale, n, serving=n)
        for name, n in split.items()
        if n
    }


def spare_split(base: dict[str, int], pool: int) -> dict[str, int]:
    """Each role's own spare GPUs: the pool in proportion to the base split's GPUs."""
    gpus = {r: n * WIDTH[r] for r, n in base.items() if n}
    total = sum(gpus.values())
    spares = {r: (pool * g // total) // WIDTH[r] * WIDTH[r] for r, g in gpus.items()}
    spares["rollout"] += pool - sum(spares.values())
    return spares


def pool_observer(policy: PoolPolicy, most: dict[str, int]):
    def observe(scaler: Scaler, waiting: str | None) -> None:
        roles = tuple(
            RoleView(
                role=s.name,
                width=s.width,
                engines=s.engines,
                serving=s.serving,
                held=s.held,
                most=most[s.name],
                outstanding=s.outstanding,
                answered=s.answered,
                start_s=s.start_s,
                busy=s.busy_until is not None,
                phase=s.name == "rollout" and s.work is not None,
            )
            for s in scaler.roles.values()
        )
        for move in policy.decide(PoolView(scaler.now, scaler.free(""), roles, waiting)):
            if scaler.request(move.role, move.direction, move.target, move.reason, move.evidence):
                policy.accepted(move, scaler.now)

    return observe


def spares_autoscalers(roles: dict[str, RoleState], spares: dict[str, int]):
    """Each role's own autoscaler: the load observer (teacher, judge), the phase hook (rollout)."""
    bounds = {r: (s.planned, s.planned + spares.get(r, 0) // s.width) for r, s in roles.items()}
    load = {
        r: LoadPolicy(
            AutoscaleConfig(
                target_queue_per_engine=TARGET_QUEUE,
                scale_up_window_s=4,
                scale_down_window_s=60,
                cooldown_s=30,
                interval_s=INTERVAL_S,
            ),
            bounds[r],
        )
        for r in roles
        if r != "rollout"
    }
    phase = PhasePolicy(RolloutAutoscaleConfig(target_phase_s=60.0), bounds["rollout"])

    def scaling(s: RoleState) -> Scaling:
        return Scaling(s.engines, s.busy_until is not None, s.last_ended)

    def observe(scaler: Scaler, waiting: str | None) -> None:
        for role, policy in load.items():
            s = scaler.roles[role]
            running = min(s.outstanding, s.serving * SLOTS)
            decision = policy.decide(
                Load(s.outstanding - running, running, 0), scaling(s), scaler.now
            )
            if decision is not None:
                scaler.request(role, decision.direction, decision.target, decision.reason)

    return observe, phase, scaling


def run(
    setup: str, steps: list[StepWork], inference: int, start_scale: float
) -> tuple[float, int, list[dict]]:
    """(mean step seconds, scale operations, each operation's decision) of one setup."""
    used = {r for s in steps for r in ROLE_FIELDS if getattr(s, r) is not None}
    if setup == "static":
        roles = roles_for(best_split(steps, inference, used), start_scale)
        cluster = Cluster(Scaler(roles, 0), None)
    else:
        pool = int(inference * POOL_SHARE) // 2 * 2
        base = best_split(steps, inference - pool, used)
        roles = roles_for(base, start_scale)
        if setup == "pool":
            most = {r: s.planned + pool // s.width for r, s in roles.items()}
            scaler = Scaler(roles, pool)
            cluster = Cluster(
                scaler, pool_observer(PoolPolicy(PoolPolicyConfig(TARGET_QUEUE)), most)
            )
        else:
            spares = spare_split(base, pool)
            scaler = Scaler(roles, spares)
            observe, phase, scaling = spares_autoscalers(roles, spares)

            def on_phase(started: float, ended: float, engines: int, requests: float) -> None:
                s = roles["rollout"]
                decision = phase.decide(
                    RolloutPhase(started, ended, engines, int(requests)), scaling(s)
                )
                if decision is not None:
                    scaler.request("rollout", decision.direction, decision.target)

            cluster = Cluster(scaler, observe, on_phase)
    times = cluster.run(steps)
    return sum(times) / len(times), len(cluster.scaler.log), cluster.scaler.log


ROLE_FIELDS = ("rollout", "teacher", "genrm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--start-scale", type=float, default=1.0, help="x every start-up time")
    parser.add_argument("--log", type=Path, help="write the pool's decisions here (JSON lines)")
    args = parser.parse_args()
    print(__doc__)
    print(f"steps {args.steps}, start-up x {args.start_scale:g}\n")
    print(
        "| workload | GPUs | static s/step | per-role spares | shared pool | pool ÷ static |"
        " pool ÷ spares | moves (spares / pool) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (_, load) in WORKLOADS.items():
        for gpus in (64, 512):
            inference, train = gpus * 3 // 4, gpus // 4
            samples = inference // 8 * 64 * 8
            steps = [
                step_work(load(s, args.steps, samples), train, args.start_scale)
                for s in range(args.steps)
            ]
            static, _, _ = run("static", steps, inference, args.start_scale)
            spares, spare_moves, _ = run("spares", steps, inference, args.start_scale)
            pool, pool_moves, log = run("pool", steps, inference, args.start_scale)
            if args.log:
                with args.log.open("a") as out:
                    out.writelines(
                        json.dumps({"workload": name, "gpus": gpus, **e}) + "\n" for e in log
                    )
            print(
                f"| {name} | {gpus} | {static:.1f} | {spares:.1f} | {pool:.1f} | "
                f"{pool / static:.3f} | {pool / spares:.3f} | {spare_moves} / {pool_moves} |"
            )
    print()
    for name, (what, _) in WORKLOADS.items():
        print(f"- {name}: {what}")


if __name__ == "__main__":
    main()
