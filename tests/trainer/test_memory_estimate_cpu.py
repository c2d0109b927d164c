"""The memory plan's figures (relax_launch/placement/memory.py) held against measurement on the CPU.

Trainer: job configs derived from configs/quickstart_cpu.yaml (two trainer ranks, DP=2). One
torchrun job (memory_estimate_worker.py) builds the real Megatron-core trainer of each and
takes two train steps (Adam's state exists from the first step's end: the second is the steady
state the plan estimates) on a batch of the size the config implies: per DP rank
prompts_per_step x n_samples_per_prompt / DP sequences of max_prompt + max_response tokens, in
micro-batches of micro_batch_size. It sums the bytes tensors hold, from the profiler's record of
every allocation and free. Each rank's peak over build and steps must be within ±20 % of the
plan's figure for its device (every trainer term but the per-process runtime), and so must its
two parts: the state resident between steps (parameters, gradients, master weights, optimizer
state, a KL reference) and what a step adds to it (activations and logits). A trainer rank's
runtime (its anonymous memory after imports: the libraries' shared code pages it maps vary
with what other processes left in the page cache) is held against RUNTIME_BYTES.

Default run (~40 s): the 4-layer SmolLM2 student, one micro-batch of 4 x 144 tokens per DP
rank, in five configurations. Slow (two torchrun jobs of ~2 min, an engine test of ~40 s):
SmolLM2-135M (30 layers) in seven configurations, one in the quickstart's own shape (two
micro-batches per rank); a 70M-parameter Qwen3-MoE with EP=2; the process's peak RSS (less the
shared code pages mapped before the build) against the plan's whole figure, runtime included;
and SGLang CPU engines: SmolLM2's weights and KV cache (its scheduler's RSS less that of an
engine of a ~0-byte model) and the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from torchrun_worker import run_worker

from relax_launch.config import JobConfig, load_config
from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model
from relax_launch.placement import PlacementPlan, plan
from relax_launch.placement.memory import RUNTIME_BYTES
from relax_launch.placement.memory_plan import memory_plan

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "quickstart_cpu.yaml"
WORKER = Path(__file__).with_name("memory_estimate_worker.py")
TOLERANCE = 0.20
GB = 1e9
STATE = ("parameters", "gradients", "master weights", "optimizer state", "KL reference")
STEP = ("activations", "logits")
ONE_MICRO_BATCH = ("data.prompts_per_step=2",)  # 8 sequences: 4 per DP rank, one micro-batch
STUDENT = ("trainer.model=builtin:smollm2-student", *ONE_MICRO_BATCH)
FAST = {
    "student fp32": STUDENT,
    "student bf16": (*STUDENT, "trainer.dtype=bfloat16"),
    "student bf16 dist-opt": (
        *STUDENT,
        "trainer.dtype=bfloat16",
        "trainer.distributed_optimizer=true",
    ),
    "student LoRA r=8": (*STUDENT, "trainer.lora.rank=8"),
    "student recompute=full": (*STUDENT, "trainer.recompute=full"),
}
SLOW_PRECISIONS = {  # SmolLM2-135M: dtypes and optimizers
    "smollm2 fp32, 2 micro-batches": (),  # the quickstart itself
    "smollm2 bf16": (*ONE_MICRO_BATCH, "trainer.dtype=bfloat16"),
    "smollm2 bf16 dist-opt": (
        *ONE_MICRO_BATCH,
        "trainer.dtype=bfloat16",
        "trainer.distributed_optimizer=true",
    ),
    "smollm2 fp32 dist-opt": (*ONE_MICRO_BATCH, "trainer.distributed_optimizer=true"),
}
SLOW_VARIANTS = {  # SmolLM2-135M: adapters, recomputation, a reference model
    "smollm2 LoRA r=8": (*ONE_MICRO_BATCH, "trainer.lora.rank=8"),
    "smollm2 recompute=full": (*ONE_MICRO_BATCH, "trainer.recompute=full"),
    "smollm2 KL reference": (*ONE_MICRO_BATCH, "algorithm.kl_coef=0.05"),
}
RSS_CASE = "smollm2 fp32, process RSS"  # not profiled: the process's peak resident set


def job_of(overrides: tuple[str, ...]) -> tuple[JobConfig, PlacementPlan]:
    job = load_config(CONFIG, list(overrides))
    return job, plan(job)


def estimate(job: JobConfig, placement: PlacementPlan) -> dict[str, float]:
    """The plan's trainer terms for rank 0 (DP ranks alike), bytes, by part."""
    memory = memory_plan(job, placement)
    device = next(d for d in memory.devices if d.rank == placement.trainer.ranks[0])
    terms = next(h for h in device.holders if h.role == "trainer").terms
    kept = [t for t in terms if not t.host]
    parts = {
        name: sum(t.bytes for t in kept if t.name in names)
        for name, names in (("state", STATE), ("step", STEP), ("runtime", ("runtime",)))
    }
    return parts | {"total": parts["state"] + parts["step"]}


def worker_case(name: str, job: JobConfig, placement: PlacementPlan, **extra: object) -> dict:
    """The worker's description of the case: the trainer section, layout and batch shape."""
    layout = placement.trainer
    assert layout.ranks == (0, 1), layout  # the worker's world: two trainer ranks
    data = job.data
    return {
        "name": name,
        "section": job.trainer.model_dump(mode="json"),
        "model_dir": str(ensure_model(job.trainer.model)),
        "layout": {
            "tp": layout.tp_size,
            "pp": layout.pp_size,
            "dp": layout.dp_size,
            "ep": layout.ep_size,
        },
        "sequences": data.prompts_per_step * job.algorithm.n_samples_per_prompt // layout.dp_size,
        "tokens": data.max_prompt_tokens + data.max_response_tokens,
        "kl_coef": job.algorithm.kl_coef,
        "steps": 2,
    } | extra


def measure(cases: dict[str, tuple[str, ...]], tmp: Path, env: dict, **rss: tuple) -> dict:
    """Run the worker on every case (one torchrun job); {name: (estimate, [per-rank result])}
    and the ranks' runtime reports under "runtime"."""
    planned = {name: job_of(overrides) for name, overrides in {**rss, **cases}.items()}
    described = [worker_case(n, *planned[n], rss=n in rss) for n in planned]
    path = tmp / "cases.json"
    path.write_text(json.dumps(described))
    reports = sorted(run_worker(WORKER, 2, [path], env), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1], reports
    found = {n: (estimate(*planned[n]), [r["cases"][n] for r in reports]) for n in planned}
    return found | {"runtime": [r["runtime"] for r in reports]}


def parts_of(result: dict) -> dict[str, float]:
    return {
        "total": result["peak"],
        "state": result["resident"],
        "step": result["step_peak"] - result["resident"],
    }


def check_and_print(found: dict) -> list[str]:
    """Print the estimate-vs-measured table (each part's rank farthest from the plan); the
    parts of ranks off by more than TOLERANCE."""
    print(f"\n{'case':32} {'part':6} {'plan GB':>8} {'meas. GB':>9} {'ratio':>6}  build GB    s")
    off = []
    for name, (planned, ranks) in found.items():
        if name == "runtime" or "peak_rss" in ranks[0]:
            continue
        for part in ("total", "state", "step"):
            ratios = [parts_of(result)[part] / planned[part] for result in ranks]
            rank = max(range(len(ranks)), key=lambda r: abs(ratios[r] - 1))
            if abs(ratios[rank] - 1) > TOLERANCE:
                off.append(f"{name} rank {rank} {part}: {ratios[rank]:.2f} x the plan's")
            shown = f"{name:32} {part:6} {planned[part] / GB:8.3f}"
            shown += f" {parts_of(ranks[rank])[part] / GB:9.3f} {ratios[rank]:6.2f}"
            if part == "total":
                shown += f"  {ranks[rank]['build_peak'] / GB:8.3f} {ranks[rank]['seconds']:4.0f}"
            print(shown)
    return off


def check_runtime(reports: list[dict]) -> None:
    planned = RUNTIME_BYTES[("cpu", "trainer")]
    for report in reports:
        print(
            f"trainer rank runtime: anonymous {report['anonymous'] / GB:.3f} GB (RSS "
            f"{report['rss'] / GB:.3f} GB of which shared code {report['shared_clean'] / GB:.3f} "
            f"GB, PSS {report['pss'] / GB:.3f} GB); planned {planned / GB:.3f} GB"
        )
        assert abs(report["anonymous"] / planned - 1) <= TOLERANCE, (report, planned)


@pytest.fixture(scope="module")
def student(venv_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The default cases, measured in one torchrun job."""
    return measure(FAST, tmp_path_factory.mktemp("memory-student"), venv_env)


def test_student_trainer_memory_is_within_20_percent_of_the_plan(student):
    off = check_and_print(student)
    assert not off, "\n".join(off)


def test_trainer_runtime_is_what_runtime_bytes_plans(student):
    check_runtime(student["runtime"])


@pytest.mark.slow
def test_smollm2_trainer_memory_in_each_precision_is_within_20_percent_of_the_plan(
    venv_env, tmp_path_factory
):
    found = measure(SLOW_PRECISIONS, tmp_path_factory.mktemp("memory-smollm2"), venv_env)
    off = check_and_print(found)
    assert not off, "\n".join(off)


@pytest.mark.slow
def test_lora_recompute_kl_moe_and_process_rss_are_within_20_percent_of_the_plan(
    venv_env, tmp_path_factory
):
    tmp = tmp_path_factory.mktemp("memory-variants")
    moe = build_qwen3_moe(tmp / "qwen3-moe")
    cases = SLOW_VARIANTS | {
        "qwen3-moe 70M EP=2": (*ONE_MICRO_BATCH, f"trainer.model={moe}", "trainer.ep_size=2")
    }
    found = measure(cases, tmp, venv_env, **{RSS_CASE: ONE_MICRO_BATCH})
    off = check_and_print(found)
    planned, ranks = found[RSS_CASE]
    whole = planned["total"] + planned["runtime"]
    for rank in ranks:  # what the process holds: tensors, runtime, the allocator's free lists
        own = rank["peak_rss"] - rank["shared_clean_before"]  # less the shared code pages
        print(
            f"{RSS_CASE}: peak RSS {rank['peak_rss'] / GB:.3f} GB (before the build "
            f"{rank['rss_before'] / GB:.3f}, of it shared code "
            f"{rank['shared_clean_before'] / GB:.3f}), plan {whole / GB:.3f} GB with its runtime"
        )
        if abs(own / whole - 1) > TOLERANCE:
            off.append(f"{RSS_CASE}: peak RSS less shared code {own / GB:.3f} GB")
    check_runtime(found["runtime"])
    assert not off, "\n".join(off)


def build_qwen3_moe(out: Path) -> Path:
    """A random Qwen3-MoE of 70M parameters (6 layers, hidden 512, 16 experts of 384, top-4):
    big enough that its memory is well above the measurement's noise."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=384,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    return out


def engine_rss(server: SGLangServer) -> dict[str, int]:
    """RSS of the server's processes by name (the scheduler holds weights and KV cache)."""
    root = psutil.Process(server.pid)
    found: dict[str, int] = {}
    for process in (root, *root.children(recursive=True)):
        name = process.name()
        found[name] = found.get(name, 0) + process.memory_info().rss
    return found


def serve(ref: str, settings: dict, log_dir: Path) -> dict[str, int]:
    """Start an engine for ``ref``, read its processes' RSS once it is ready, stop it."""
    server = SGLangServer(
        model_path=ensure_model(ref),
        device="cpu",
        log_path=log_dir / f"{ref.split(':')[-1]}.log",
        engine=settings,
    )
    server.start(timeout_s=240)
    try:
        return engine_rss(server)
    finally:
        server.stop()


@pytest.mark.slow
def test_engine_weights_and_kv_cache_are_within_20_percent_of_the_plan(tmp_path):
    job, placement = job_of(())
    engine = placement.engines_of("rollout")[0]
    memory = memory_plan(job, placement)
    holder = next(h for d in memory.devices if d.rank == engine.ranks[0] for h in d.holders)
    planned = {t.name: t.bytes for t in holder.terms}
    settings = {
        **job.rollout.engine,
        "dtype": job.engine_dtype("rollout"),
        "random_seed": 0,
        "enable_metrics": True,
    }
    tiny = serve("builtin:tiny-llama", settings, tmp_path)  # a model of ~0 bytes
    smollm2 = serve(job.rollout_model(), settings, tmp_path)
    model_part = smollm2["sglang::scheduler"] - tiny["sglang::scheduler"]
    expected = planned["weights"] + planned["KV cache"]
    print(
        f"\nengine {settings}: scheduler RSS SmolLM2 {smollm2['sglang::scheduler'] / GB:.3f} "
        f"GB - tiny {tiny['sglang::scheduler'] / GB:.3f} GB = {model_part / GB:.3f} GB; plan: "
        f"weights {planned['weights'] / GB:.3f} + KV cache {planned['KV cache'] / GB:.3f} GB; "
        f"processes of the tiny engine {sum(tiny.values()) / GB:.3f} GB {tiny}, plan's "
        f"runtime {planned['runtime'] / GB:.3f} GB"
    )
    assert abs(model_part / expected - 1) <= TOLERANCE, (model_part, expected)
    assert abs(sum(tiny.values()) / planned["runtime"] - 1) <= TOLERANCE, (tiny, planned)
