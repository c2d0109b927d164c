"""Every rejection of docs/placement.md is a ConfigError naming the field and the fix."""

from __future__ import annotations

import json

import pytest

from relax_launch.config import ConfigError, build_config
from relax_launch.placement import check_runnable, plan, preflight

# A valid 4-rank decoupled job on the CPU: trainer 0-1, rollout 2-3.
BASE = {
    "cluster": {"nnodes": 1, "nproc_per_node": 4, "device": "cpu"},
    "trainer": {"model": "builtin:tiny-llama", "ranks": 2},
    "rollout": {"ranks": 2, "engine": {"max_total_tokens": 2048}},
    "algorithm": {"n_samples_per_prompt": 4},
    "data": {"prompts_per_step": 2},
}
TEACHER = ["teacher.model=builtin:tiny-llama", "teacher.engine.max_total_tokens=2048"]
GENRM = ["genrm.model=builtin:tiny-llama", "genrm.engine.max_total_tokens=2048"]
JUDGE = [
    "reward.sources=[{name: answer, function: 'builtin:exact_numeric'}, {name: j, genrm: true}]"
]
EIGHT = ["cluster.nnodes=2"]
VLM = "trainer.model=builtin:tiny-qwen2.5-vl"
PIL = "rollout.engine.image_processor_backend=pil"
MOE = "trainer.model=builtin:tiny-qwen3-moe"
SPLIT = [
    "placement.mode=split",
    "trainer.ranks=null",
]


def check(overrides, raw=None, world_size=None):
    """Load, plan and preflight (models required) like the launcher does."""
    job = build_config(BASE if raw is None else raw, overrides)
    placement = plan(job, world_size=world_size)
    return preflight(job, placement, require_models=True)


def test_base_config_is_valid():
    assert check([]) == []


CASES = {
    "unknown field suggests the name": (
        ["rollout.tp_sise=1"],
        ["rollout.tp_sise", "did you mean 'tp_size'"],
    ),
    "unknown section": (["telemetry.on=true"], ["telemetry", "unknown field"]),
    "zero-rank role": (["rollout.ranks=0"], ["rollout.ranks", "at least 1"]),
    "LoRA target named as in Hugging Face": (
        ["trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj]"],
        ["trainer.lora.target_modules", "fused into the trainer's linear_qkv", "target linear_qkv"],
    ),
    "LoRA adapter serving when colocated": (
        [*SPLIT, "trainer.lora.rank=4", "trainer.lora.engines=adapter"],
        ["trainer.lora.engines=adapter needs placement.mode=decoupled", "engines=merged"],
    ),
    "teacher without a model": (
        ["teacher.ranks=1", "algorithm.distill_coef=0.1", "rollout.ranks=1"],
        ["teacher.model", "required"],
    ),
    "genrm without a model": (
        ["genrm.ranks=1", "rollout.ranks=1", *JUDGE],
        ["genrm.model", "required"],
    ),
    "rank budget too large": (
        ["rollout.ranks=3"],
        ["trainer.ranks=2 + rollout.ranks=3 = 5", "1 rank more"],
    ),
    "rank budget leaves ranks idle": (["rollout.ranks=1"], ["leaves 1 rank idle"]),
    "an engine's width stated the old way": (
        ["rollout.ranks_per_engine=2"],
        ["rollout", "ranks_per_engine is not a field", "tp_size: 2"],
    ),
    "prefill engines counted in the rank budget": (
        ["rollout.prefill.ranks=1"],
        ["(rollout.ranks=2 + rollout.prefill.ranks=1)", "1 rank more"],
    ),
    "prefill engines not dividing the decode engines": (
        ["rollout.ranks=1", "rollout.prefill.ranks=2", "cluster.nproc_per_node=5"],
        ["1 decode engines", "2 prefill engines", "must divide the decode engines"],
    ),
    "prefill ranks not a multiple of a prefill engine": (
        ["rollout.ranks=1", "rollout.prefill.ranks=1", "rollout.prefill.tp_size=2"],
        ["rollout.prefill.ranks=1 is not a multiple of one engine's 2 ranks"],
    ),
    "prefill engines in a colocated placement": (
        [*SPLIT, "rollout.ranks=1", "rollout.prefill.ranks=1"],
        ["rollout.prefill", "needs placement.mode=decoupled", "registers that memory"],
    ),
    "pipeline-parallel halves of a rollout pair": (
        [
            "rollout.ranks=1",
            "rollout.prefill.ranks=1",
            "cluster.nproc_per_node=5",
            "rollout.prefill.pp_size=2",
            "rollout.prefill.ranks=2",
        ],
        ["rollout.prefill", "rollout.pp_size=1 and rollout.prefill.pp_size=1"],
    ),
    "prefill engines with fault tolerance but one pair": (
        ["rollout.ranks=1", "rollout.prefill.ranks=1", "rollout.fault_tolerance=true"],
        [
            "rollout.fault_tolerance needs two or more prefill/decode pairs",
            "make 1 decode and 1 prefill engines",
        ],
    ),
    "teacher prefill engines in a colocated placement": (
        [
            *SPLIT,
            *TEACHER,
            "teacher.ranks=1",
            "teacher.prefill.ranks=1",
            "rollout.ranks=1",
            "algorithm.distill_coef=0.1",
        ],
        ["teacher.prefill", "needs placement.mode=decoupled"],
    ),
    "ranks not divisible by an engine's width": (
        ["trainer.ranks=1", "rollout.ranks=3", "rollout.tp_size=2"],
        ["rollout.ranks=3 is not a multiple of one engine's 2 ranks"],
    ),
    "engine crosses a node": (
        [
            *EIGHT,
            "trainer.ranks=3",
            "rollout.ranks=4",
            "rollout.tp_size=2",
            *TEACHER,
            "teacher.ranks=1",
            "algorithm.distill_coef=0.1",
            "data.prompts_per_step=3",
        ],
        ["rollout engine 0 (ranks 3-4) would cross a node boundary"],
    ),
    "multi-node engine not whole nodes": (
        [*EIGHT, "rollout.ranks=6", "rollout.tp_size=6"],
        ["must use whole nodes"],
    ),
    "multi-node engine off a node boundary": (
        [
            "cluster.nnodes=3",
            "rollout.ranks=8",
            "rollout.tp_size=8",
            *TEACHER,
            "teacher.ranks=2",
            "algorithm.distill_coef=0.1",
        ],
        ["start it on a node boundary"],
    ),
    "trainer TP wider than a node": (
        [*EIGHT, "trainer.ranks=8", "trainer.tp_size=8", "cluster.nnodes=3", "rollout.ranks=4"],
        ["trainer.tp_size=8 would make a tensor-parallel group cross a node boundary"],
    ),
    "trainer TP not dividing the node": (
        ["trainer.ranks=3", "trainer.tp_size=3", "rollout.ranks=1"],
        ["trainer.tp_size=3", "divides cluster.nproc_per_node=4"],
    ),
    "trainer TP x PP not dividing its ranks": (
        ["trainer.pp_size=3"],
        ["tp_size x cp_size x pp_size = 1 x 1 x 3 does not divide the 2 trainer ranks"],
    ),
    "trainer CP not dividing its ranks": (
        ["trainer.cp_size=3"],
        ["tp_size x cp_size x pp_size = 1 x 3 x 1 does not divide the 2 trainer ranks"],
    ),
    "micro-batch size beside a token budget": (
        ["trainer.micro_batch_size=2", "trainer.max_tokens_per_micro_batch=4096"],
        ["trainer.micro_batch_size and trainer.max_tokens_per_micro_batch", "set one of them"],
    ),
    "token budget below the longest sequence": (
        ["trainer.max_tokens_per_micro_batch=8"],
        ["trainer.max_tokens_per_micro_batch=8 is below the longest sequence", "raise it"],
    ),
    "context and expert parallelism together": (
        ["trainer.cp_size=2", "trainer.ep_size=2"],
        ["trainer.cp_size > 1 with trainer.ep_size > 1 is not supported"],
    ),
    "split: same-phase co-residency": (
        [
            *SPLIT,
            "rollout.ranks=4",
            *TEACHER,
            "teacher.ranks=2",
            "algorithm.distill_coef=0.1",
        ],
        ["same-phase co-residency is unsupported", "placement.mode=defer"],
    ),
    "a removed field names itself": (
        ["trainer.offload=true"],
        ["trainer.offload", "unknown field"],
    ),
    "defer with async training": (
        [
            "placement.mode=defer",
            "trainer.ranks=null",
            "algorithm.off_policy_steps=1",
        ],
        ["algorithm.off_policy_steps=1", "placement.mode=defer cannot"],
    ),
    "defer with an engine that would keep its memory": (
        ["placement.mode=defer", "trainer.ranks=null", "rollout.engine.enable_memory_saver=false"],
        ["rollout.engine sets enable_memory_saver off", "placement.mode=defer needs it"],
    ),
    "an operation timeout in decoupled mode": (
        ["placement.operation_timeout_s=30"],
        ["placement.operation_timeout_s", "decoupled has none: remove it"],
    ),
    "a staggered start in decoupled mode": (
        ["placement.staggered_start=true"],
        ["placement.staggered_start", "decoupled has none: remove it"],
    ),
    "colocated trainer.ranks set": (
        ["placement.mode=split"],
        ["remove trainer.ranks"],
    ),
    "decoupled without trainer.ranks": (["trainer.ranks=null"], ["trainer.ranks is required"]),
    "defer role larger than the world": (
        [
            "placement.mode=defer",
            "trainer.ranks=null",
            "rollout.ranks=6",
        ],
        ["rollout.ranks=6 exceed it"],
    ),
    "teacher configured but unused": (
        [*TEACHER, "teacher.ranks=1", "rollout.ranks=1"],
        ["algorithm.distill_coef is 0"],
    ),
    "distillation without a teacher": (["algorithm.distill_coef=0.5"], ["needs a teacher"]),
    "fault tolerance with one rollout engine": (
        ["rollout.fault_tolerance=true", "rollout.tp_size=2"],
        ["rollout.fault_tolerance needs two or more rollout engines (rollout.ranks=2 makes one)"],
    ),
    "fault tolerance of prefill/decode pairs behind sglang-router": (
        [
            "cluster.nproc_per_node=6",
            "rollout.prefill.ranks=2",
            "rollout.fault_tolerance=true",
            "gateway.rollout_route_mode=router",
        ],
        ["rollout.fault_tolerance needs gateway.rollout_route_mode=direct with rollout.prefill"],
    ),
    "fault tolerance colocated": (
        [*SPLIT, "rollout.fault_tolerance=true"],
        ["rollout.fault_tolerance needs placement.mode=decoupled (not split)"],
    ),
    "genrm reward without genrm": (JUDGE, ["no genrm section"]),
    "genrm configured but unused": (
        [*GENRM, "genrm.ranks=1", "rollout.ranks=1"],
        ["genrm is configured"],
    ),
    "planner-owned engine field": (["rollout.engine.tp_size=2"], ["set by the placement planner"]),
    "cpu engine without max_total_tokens": (
        ["rollout.engine={}"],
        ["rollout.engine.max_total_tokens is required with cluster.device=cpu"],
    ),
    "context shorter than prompt + response": (
        ["rollout.engine.context_length=100"],
        ["context_length=100 is shorter", "= 384"],
    ),
    "batch not divisible over DP x micro-batch": (
        ["data.prompts_per_step=1", "algorithm.n_samples_per_prompt=3"],
        ["3 samples", "multiple of 2"],
    ),
    "trainer TP not dividing the model's heads": (
        ["trainer.model=builtin:smollm2-135m-instruct", "trainer.tp_size=2"],
        ["trainer.tp_size=2 must divide the model's 9 attention heads", "e.g. 1"],
    ),
    "engine TP not dividing the model's heads": (
        ["trainer.model=builtin:smollm2-135m-instruct", "rollout.tp_size=2"],
        ["rollout engine tp_size=2 must divide the model's 9 attention heads"],
    ),
    "trainer PP not dividing layers": (
        [
            *EIGHT,
            "trainer.pp_size=4",
            "trainer.ranks=4",
            "rollout.ranks=4",
            "trainer.model=builtin:smollm2-135m-instruct",
        ],
        ["trainer.pp_size=4 must divide the model's 30 layers"],
    ),
    "rollout model shaped unlike the trainer": (
        ["rollout.model=builtin:smollm2-135m-instruct"],
        ["differ in shape", "leave rollout.model unset"],
    ),
    "teacher with another vocabulary": (
        [
            "teacher.model=builtin:smollm2-135m-instruct",
            "teacher.engine.max_total_tokens=2048",
            "teacher.ranks=1",
            "rollout.ranks=1",
            "algorithm.distill_coef=0.1",
        ],
        ["49152-token vocabulary", "share one tokenizer"],
    ),
    "unknown builtin model": (
        ["trainer.model=builtin:gpt-9"],
        ["'builtin:gpt-9' is not a builtin model"],
    ),
    "vision-language policy without the PIL image processor on the CPU": (
        [VLM],
        ["rollout.engine.image_processor_backend: set it to pil", "must equal the engine's"],
    ),
    "vision-language policy with another image processor on a GPU": (
        [VLM, "cluster.device=cuda", "rollout.engine.image_processor_backend=torchvision"],
        ["rollout.engine.image_processor_backend: set it to pil", "must equal the engine's"],
    ),
    "LoRA served as an adapter on a vision-language policy": (
        [VLM, PIL, "trainer.lora.rank=4", "trainer.lora.engines=adapter"],
        ["trainer.lora.engines=adapter is not built for a vision-language", "engines=merged"],
    ),
    "LoRA on a vision-language policy with its tower trained": (
        [VLM, PIL, "trainer.lora.rank=4", "trainer.freeze_vision=false"],
        ["trainer.freeze_vision=false with trainer.lora", "keeps the vision tower as loaded"],
    ),
    "context parallelism on a vision-language policy": (
        [VLM, PIL, "trainer.cp_size=2"],
        ["trainer.cp_size > 1 is not built for a vision-language"],
    ),
    "prefill/decode engines on a vision-language policy": (
        [VLM, PIL, "rollout.ranks=1", "rollout.prefill.ranks=1"],
        ["rollout.prefill (prefill/decode disaggregation) is not built for a vision-language"],
    ),
    "a critic on a vision-language policy": (
        [VLM, PIL, "algorithm.advantage_estimator=gae", "critic.lr=1e-5"],
        ["a critic section is not built for a vision-language"],
    ),
    "an environment module on a vision-language policy": (
        [VLM, PIL, "rollout.environment.module=tiny_env_tool"],
        ["rollout.environment is not built for a vision-language"],
    ),
    "one row per agentic turn on a vision-language policy": (
        [VLM, PIL, "rollout.function=builtin:calculator", "rollout.multi_turn=per_turn"],
        ["rollout.multi_turn=per_turn is not built for a vision-language", "continue_tokens"],
    ),
    "images for a text policy": (
        ["data.dataset=builtin:shape_counting"],
        ["data.dataset=builtin:shape_counting shows images", "vision-language trainer.model"],
    ),
    "eval images for a text policy": (
        ["eval.data.dataset=builtin:shape_counting"],
        ["eval.data.dataset=builtin:shape_counting shows images", "vision-language"],
    ),
    "freeze_vision on a text policy": (
        ["trainer.freeze_vision=true"],
        ["trainer.freeze_vision acts on a vision-language trainer.model", "remove it"],
    ),
    "model directory missing": (
        ["trainer.model=/nonexistent/model"],
        ["trainer.model='/nonexistent/model' has no readable config.json"],
    ),
    "dataset file missing": (
        ["data.dataset=/nonexistent/prompts.jsonl"],
        ["data.dataset", "does not exist"],
    ),
    "image directory missing": (
        ["gateway.images.allowed_dirs=[/nonexistent/images]"],
        ["gateway.images.allowed_dirs", "are not directories here", "create them"],
    ),
    "image directory relative": (
        ["gateway.images.allowed_dirs=[images]"],
        ["gateway.images.allowed_dirs", "'images' is not an absolute path"],
    ),
    "unknown builtin dataset": (["data.dataset=builtin:chess"], ["unknown built-in dataset"]),
    "dataset dataset of an unread format": (
        ["data.dataset=prompts.csv"],
        ["neither builtin:NAME, a .jsonl or .parquet file nor a directory"],
    ),
    "reward source with both kinds": (
        ["reward.sources=[{name: a, function: 'm:f', genrm: true}]"],
        ["exactly one of function"],
    ),
    "reward function not an import path": (
        ["reward.sources=[{name: a, function: 'not a path'}]"],
        ["package.module:function"],
    ),
    "reward names repeated": (
        ["reward.sources=[{name: a, function: 'm:f'}, {name: a, function: 'm:g'}]"],
        ["unique; repeated: a"],
    ),
    "unknown builtin reward": (
        ["reward.sources=[{name: a, function: 'builtin:vibes'}]"],
        ["unknown built-in reward"],
    ),
    "GRPO with one sample per prompt": (
        ["algorithm.n_samples_per_prompt=1"],
        ["n_samples_per_prompt", "2"],
    ),
    "expert parallelism of a dense model": (
        ["trainer.ep_size=2"],
        ["trainer.ep_size=2", "dense model", "trainer.ep_size=1"],
    ),
    "expert parallelism wider than data parallelism": (
        [MOE, "trainer.ep_size=4"],
        ["trainer.ep_size=4 must divide the trainer's data-parallel size 2"],
    ),
    "routing replay of a dense model": (
        ["algorithm.routing_replay=true"],
        ["algorithm.routing_replay", "is dense"],
    ),
    "routing replay with a rollout function": (
        [MOE, "algorithm.routing_replay=true", "rollout.function=tiny_agent:run"],
        ["algorithm.routing_replay records the experts of each generate call"],
    ),
    "the control's routing replay on a dense model": (
        ["algorithm.control.routing_replay={}"],
        ["algorithm.control.routing_replay", "is dense"],
    ),
    "the control's routing replay with a rollout function": (
        [MOE, "algorithm.control.routing_replay={}", "rollout.function=tiny_agent:run"],
        ["algorithm.control.routing_replay records the experts of each generate call"],
    ),
    "the control's routing replay with prefill engines": (
        [MOE, "algorithm.control.routing_replay={}", "rollout.prefill.ranks=1"],
        ["algorithm.routing_replay and algorithm.control.routing_replay off"],
    ),
    "the control's staleness action without the fully asynchronous schedule": (
        ["algorithm.control.staleness={}"],
        ["algorithm.control.staleness acts only with algorithm.max_staleness"],
    ),
    "a control without an action": (
        ["algorithm.control={}"],
        ["algorithm.control has no action"],
    ),
    "LoRA on a mixture-of-experts model": (
        [MOE, "trainer.lora.rank=4"],
        ["trainer.lora", "adapters on experts are not supported"],
    ),
    "elastic engines without their reserved ranks": (
        ["rollout.max_engines=3"],
        ["(rollout.ranks=2 + 1 reserved for rollout.max_engines)", "needs 1 rank more"],
    ),
    "elastic engines below the planned ones": (
        ["rollout.max_engines=1"],
        ["max_engines=1 is below the 2 planned engines"],
    ),
    "elastic engines colocated": (
        [*SPLIT, "rollout.max_engines=2"],
        ["rollout.max_engines reserves ranks", "placement.mode=split cannot do yet"],
    ),
    "elastic engines of a disaggregated role": (
        ["rollout.ranks=1", "rollout.prefill.ranks=1", "rollout.max_engines=2", "trainer.ranks=1"],
        ["rollout.max_engines with rollout.prefill"],
    ),
    "an autoscaler without max_engines": (
        ["rollout.autoscale.target_queue_per_engine=2"],
        ["autoscale needs max_engines"],
    ),
    "an autoscaler beyond max_engines": (
        ["rollout.ranks=1", "rollout.max_engines=2", "rollout.autoscale.max_engines=3"],
        ["autoscale wants 1 to 3 engines, outside the 1 planned to max_engines=2"],
    ),
    "optimizer offload without the distributed optimizer": (
        ["trainer.optimizer_offload=true"],
        ["trainer.optimizer_offload needs trainer.distributed_optimizer=true"],
    ),
    "optimizer offload on the CPU": (
        ["trainer.optimizer_offload=true", "trainer.distributed_optimizer=true"],
        ["trainer.optimizer_offload", "cluster.device=cpu it is there already", "=false"],
    ),
    "bad device": (["cluster.device=tpu"], ["cluster.device", "'cpu' or 'cuda'"]),
    "bad job name": (["name=my job"], ["name", "pattern"]),
    "override without =": (["rollout.ranks"], ["must look like section.field=value"]),
    "override into a value": (
        ["trainer.model.path=x"],
        ["trainer.model is a value, not a section"],
    ),
}


@pytest.mark.parametrize("overrides,expected", CASES.values(), ids=CASES.keys())
def test_rejection_names_field_and_fix(overrides, expected):
    with pytest.raises(ConfigError) as info:
        check(overrides)
    message = str(info.value)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert "Traceback" not in message


def test_launcher_world_size_must_match_cluster():
    with pytest.raises(ConfigError, match="the launcher started 8 ranks but .* = 1 x 4 = 4"):
        check([], world_size=8)


def test_model_without_architectures_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 320}
        )
    )
    with pytest.raises(ConfigError, match="no 'architectures' entry"):
        check([f"trainer.model={tmp_path}"])


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"architectures": ["MixtralForCausalLM"]}, "architecture MixtralForCausalLM is not one"),
        ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"type": "yarn"}}, "'yarn'"),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "sliding_window"),
    ],
)
def test_a_trainer_model_the_conversion_cannot_map_is_refused_before_any_process(
    tmp_path, config, named
):
    shape = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 320}
    (tmp_path / "config.json").write_text(json.dumps({**shape, **config}))
    with pytest.raises(ConfigError) as info:
        check([f"trainer.model={tmp_path}"])
    assert named in str(info.value) and "trainer.model" in str(info.value)
    assert "supported" in str(info.value)
    # a teacher is only served, never converted: any architecture SGLang runs
    check(TEACHER[1:] + [f"teacher.model={tmp_path}", "rollout.ranks=1", "teacher.ranks=1",
                         "algorithm.distill_coef=0.1"])  # fmt: skip


def test_rejections_are_many_and_distinct():
    messages = set()
    for overrides, _ in CASES.values():
        with pytest.raises(ConfigError) as info:
            check(overrides)
        messages.add(str(info.value))
    assert len(messages) >= 25


# One rollout engine, TP 2, over two one-rank nodes (and the trainer on a third).
SPANNING = {
    **BASE,
    "cluster": {"nnodes": 3, "nproc_per_node": 1, "device": "cpu"},
    "trainer": {"model": "builtin:tiny-llama", "ranks": 1},
    "rollout": {
        "ranks": 2,
        "tp_size": 2,
        **{"engine": BASE["rollout"]["engine"]},
    },
}


def test_an_engine_spanning_nodes_runs_decoupled_without_fault_tolerance():
    job = build_config(SPANNING, [])
    placement = plan(job)
    assert placement.engines[0].nodes == (1, 2)
    assert placement.engine_node_heads(placement.engines[0]) == (1, 2)
    check_runnable(job, placement)  # accepted
    two_engines = ["cluster.nnodes=5", "rollout.ranks=4"]  # fault tolerance needs two
    tolerant = build_config(SPANNING, [*two_engines, "rollout.fault_tolerance=true"])
    with pytest.raises(ConfigError, match="cannot be restarted alone") as refused:
        check_runnable(tolerant, plan(tolerant))
    assert "rollout.fault_tolerance" in refused.value.fields


def test_fault_tolerance_runs_fully_asynchronous_and_with_two_prefill_decode_pairs():
    """Neither is refused any more: the fully asynchronous rollout's interrupted generations
    continue on the engines left, and a pair's half restarts and rejoins its partner."""
    tolerant = ["rollout.fault_tolerance=true"]
    check([*tolerant, "algorithm.max_staleness=1"])  # accepted
    pairs = ["cluster.nproc_per_node=6", "rollout.prefill.ranks=2"]
    check([*tolerant, *pairs])  # accepted: two decode engines, two prefill engines
    with pytest.raises(ConfigError, match="make 2 decode and 1 prefill engines"):
        check([*tolerant, "cluster.nproc_per_node=5", "rollout.prefill.ranks=1"])


def test_an_engine_spanning_nodes_is_refused_colocated():
    two_nodes = ["cluster.nnodes=2", "cluster.nproc_per_node=1", "rollout.ranks=2", *SPLIT]
    job = build_config(BASE, [*two_nodes, "rollout.tp_size=2"])
    with pytest.raises(ConfigError, match="decoupled placement only") as refused:
        check_runnable(job, plan(job))
    assert refused.value.fields == ("placement.mode", "rollout.tp_size")


def test_elastic_and_fault_tolerant_rollout_engines_run_behind_sglang_router():
    """Neither is refused any more: the router's workers follow the engines in routing
    (``inference/router_workers.py``)."""
    router = "gateway.rollout_route_mode=router"
    check(["rollout.ranks=1", "rollout.max_engines=2", router])  # accepted
    check(["rollout.fault_tolerance=true", router])  # accepted


def test_a_vision_language_policy_with_the_pil_processor_is_accepted():
    """What the RL step with images runs (docs/vlm.md) passes the config and preflight; the
    fields it cannot use yet are the rejections above."""
    check([VLM, PIL, "data.dataset=builtin:shape_counting", "trainer.freeze_vision=true"])
    lora = [VLM, PIL, "data.dataset=builtin:shape_counting", "trainer.lora.rank=8"]
    check(lora)  # LoRA keeps the tower as loaded: freeze_vision left out, or true
    check([*lora, "trainer.freeze_vision=true"])
    # the other schedules (tests/rl/test_vlm_schedules_job.py)
    visual = [VLM, PIL, "data.dataset=builtin:shape_counting"]
    check([*visual, *SPLIT])
    check([*visual, "placement.mode=defer", "trainer.ranks=null"])
    check([*visual, "algorithm.max_staleness=1"])
    check([*visual, "eval.data.dataset=builtin:shape_counting", "eval.data.seed=7"])
