"""Environments (``rollout.environment``): an environment module written here in verifiers'
contract (tiny_env_single: one turn; tiny_env_tool: several turns around a tool) loads in a
worker process of its own, its dataset becomes the prompts, and its rollout's model calls come
back over real HTTP to the agent client, which records the engine's tokens exactly; the rubric's
reward reaches the sample. Unit tests against a scripted engine; the real job is
test_environment_job.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from test_agent import CharTokenizer, ScriptedEngine
from tiny_env_single import arithmetic_rows
from tiny_env_tool import SYSTEM

from relax_launch.config import ConfigError
from relax_launch.config.loading import load_config
from relax_launch.rl import agent
from relax_launch.rl.agent import AgentClient, converse
from relax_launch.rl.config import RewardConfig, RewardSource
from relax_launch.rl.data import Prompt
from relax_launch.rl.data_config import DataConfig
from relax_launch.rl.environment_config import EnvironmentConfig
from relax_launch.rl.environment_dataset import ROW
from relax_launch.rl.environments import EnvironmentRollout, WorkerGone
from relax_launch.rl.inputs import read_inputs
from relax_launch.rl.rewards import Rewards

HERE = Path(__file__).parent
RUBRIC = RewardConfig(sources=(RewardSource(name="rubric", function="builtin:environment"),))


@pytest.fixture(autouse=True)
def environments_importable(monkeypatch):
    """The worker is a process of its own: the environment modules on its PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def converse_in_environment(config, prompt, engine, log_dir, budget=400):
    """One conversation of the environment through an agent client on ``engine``."""
    environment = EnvironmentRollout(config, log_dir / "environment.log")
    client = AgentClient(engine, CharTokenizer(), temperature=1.0, budget=budget)

    async def one():
        try:
            return await converse(environment, prompt, client)
        finally:
            await environment.close()

    conversation, outcome = asyncio.run(one())
    return client, conversation, outcome


def row_prompt(row: int, system: str | None = None) -> Prompt:
    """Row ``row`` of the test environments' dataset (seed 0) as its prompt, made here (what
    environment_prompts gives, without a check process per test)."""
    data = arithmetic_rows(row + 1, 0, system)[row]
    return Prompt(row, tuple(data["prompt"]), data["answer"], data["task"], {ROW: row})


def test_the_environments_dataset_is_the_prompts():
    prompts = read_inputs(
        DataConfig(),
        RUBRIC,
        environment=EnvironmentConfig(module="tiny_env_tool", args={"size": 3}),
    ).prompts
    assert [p.index for p in prompts] == [0, 1, 2]
    assert prompts[0].messages[0]["role"] == "system" and prompts[0].data_source == "add"
    question = prompts[0].messages[1]["content"]
    a, b = (int(n) for n in question.removeprefix("What is ").rstrip("?").split(" + "))
    assert prompts[0].label == str(a + b)


@pytest.mark.parametrize(
    ("config", "field", "message"),
    [
        ({"module": "no_such_env"}, "module", "cannot import 'no_such_env'"),
        ({"module": "tiny_rewards"}, "module", "has no load_environment function"),
        ({"module": "tiny_env_tool", "args": {"turns": 2}}, "args", "unexpected keyword"),
        ({"module": "tiny_env_tool", "python": "/no/python"}, "python", "cannot run /no/python"),
    ],
)
def test_an_environment_that_cannot_load_is_refused_naming_the_field(config, field, message):
    with pytest.raises(ConfigError, match=message) as refused:
        read_inputs(DataConfig(), RUBRIC, environment=EnvironmentConfig(**config))
    assert refused.value.fields == (f"rollout.environment.{field}",)
    assert str(refused.value).startswith(f"rollout.environment.{field}: ")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.function=tiny_agent:two_turns", "remove rollout.function"),
        ("data.dataset=builtin:format", "remove data.dataset"),
        ('reward.sources=[{name: a, function: "builtin:exact_numeric"}]', "add {name: rubric"),
        ("rollout.environment=null", "builtin:environment is rollout.environment's rubric"),
        ("algorithm.max_staleness=1", "not built for environments yet"),
    ],
)
def test_what_the_environment_would_ignore_is_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(HERE / "environment_tiny.yaml", [override])


def test_a_single_turn_is_recorded_token_in_token_out_and_scored_by_the_rubric(tmp_path):
    config = EnvironmentConfig(module="tiny_env_single", args={"size": 2})
    prompt = row_prompt(1)
    engine = ScriptedEngine(f"It is {prompt.label}")
    client, conversation, outcome = converse_in_environment(config, prompt, engine, tmp_path)
    assert outcome == "" and conversation[-1] == {
        "role": "assistant",
        "content": engine_text(prompt),
    }
    t = client.trajectory
    rendered = CharTokenizer().apply_chat_template(
        list(prompt.messages), add_generation_prompt=True
    )
    assert t.prompt_ids == [ord(c) for c in rendered]  # the dataset's prompt, as the model saw it
    assert t.ids == [ord(c) for c in engine_text(prompt)] + [1]  # the engine's ids, its stop too
    assert t.mask == [1.0] * len(t.ids) and t.logprobs == [-0.5] * len(t.ids)
    assert client.scores == {"environment": 1.0}  # the rubric: the right number
    sample = agent.to_sample(0, (prompt, t.prompt_ids), client, conversation, outcome)
    Rewards(RUBRIC).score([sample])
    assert sample.rewards == {"rubric": 1.0} and sample.valid
    # what the environment printed went to its log, not into the worker's replies
    assert "a print of the environment's own" in (tmp_path / "environment.log").read_text()


def engine_text(prompt):
    return f"It is {prompt.label}"


def test_a_tool_call_and_its_result_are_recorded_exactly_over_several_turns(tmp_path):
    config = EnvironmentConfig(module="tiny_env_tool", args={"size": 2})
    prompt = row_prompt(0, SYSTEM)
    a, b = prompt.messages[1]["content"].removeprefix("What is ").rstrip("?").split(" + ")
    call = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    engine = ScriptedEngine(call, f"The sum is {prompt.label}")
    client, conversation, outcome = converse_in_environment(config, prompt, engine, tmp_path)
    assert outcome == "" and client.trajectory.rejected is None
    roles = [m["role"] for m in conversation]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert conversation[3]["content"] == prompt.label  # the environment ran its tool
    t, first, second = client.trajectory, [ord(c) for c in call] + [1], engine.requests[1]
    # the second turn was generated from the first turn's engine ids, then the tool result
    assert second["input_ids"][: len(t.prompt_ids) + len(first)] == t.prompt_ids + first
    between = second["input_ids"][len(t.prompt_ids) + len(first) :]
    assert CharTokenizer().decode(between) == f"\n<tool>{prompt.label}\x01\n<assistant>"
    reply = [ord(c) for c in f"The sum is {prompt.label}"] + [1]
    assert t.ids == first + between + reply
    assert t.mask == [1.0] * len(first) + [0.0] * len(between) + [1.0] * len(reply)
    assert t.turns == 2 and client.scores == {"environment": 1.0}


def test_a_conversation_over_its_budget_is_trained_as_far_as_it_went(tmp_path):
    config = EnvironmentConfig(module="tiny_env_tool", args={"size": 1, "max_turns": 3})
    prompt = row_prompt(0, SYSTEM)
    engine = ScriptedEngine("no tool", "still none", "x")
    budget = len("no tool") + 1 + len("\n<user>Call the add tool first.\x01\n<assistant>") + 3
    client, _, outcome = converse_in_environment(config, prompt, engine, tmp_path, budget)
    assert outcome == "out_of_budget" and client.trajectory.turns == 2 and not client.scores


def test_a_worker_that_dies_fails_the_step_not_the_sample(tmp_path):
    config = EnvironmentConfig(module="tiny_env_single", args={"size": 1, "die": True})
    prompt = row_prompt(0)
    with pytest.raises(WorkerGone, match="exited with code 3"):
        converse_in_environment(config, prompt, ScriptedEngine("x"), tmp_path)
