"""reasoning-gym tasks as data (``data.dataset: reasoning_gym:A+B``): rows, prompts, config
checks, resume, per-task evaluation, and the ``builtin:reasoning_gym`` reward scoring real
tasks' answers with each task's own ``score_answer`` in the scoring workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from relax_launch.config import ConfigError, load_config
from relax_launch.rl.config import RewardConfig
from relax_launch.rl.data import PromptStream, load_prompts
from relax_launch.rl.data_config import DataConfig, EvalConfig
from relax_launch.rl.evaluation import Evaluation
from relax_launch.rl.inputs import read_inputs
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.samples import Sample

TASKS = "reasoning_gym:chain_sum+basic_arithmetic"


def two_tasks(**section) -> DataConfig:
    section = {"size": 5, "tasks": {"chain_sum": {"min_terms": 2, "max_terms": 2}}} | section
    return DataConfig(dataset=TASKS, seed=3, reasoning_gym=section)


def sample(prompt, text: str) -> Sample:
    """A response to ``prompt`` as the rollout makes it (rl/rollout.py::reply_sample)."""
    return Sample(
        0, prompt.messages[-1]["content"], prompt.label, [1], [2], [0.0], text, "1",
        data_source=prompt.data_source, meta=prompt.meta,
    )  # fmt: skip


def test_rows_carry_their_task_entry_label_and_the_answer_format():
    prompts = load_prompts(two_tasks())
    assert [p.data_source for p in prompts] == ["chain_sum"] * 5 + ["basic_arithmetic"] * 5
    first = prompts[0]
    entry = first.meta["entry"]
    assert first.label == entry["answer"] and entry["metadata"]["source_dataset"] == "chain_sum"
    assert entry["metadata"]["num_terms"] == 2  # the task's own config acted
    text = first.messages[-1]["content"]
    assert text.startswith(entry["question"]) and text.endswith("<answer>42</answer>.")
    assert load_prompts(two_tasks()) == prompts  # seeded: the same rows every time
    other = load_prompts(DataConfig(dataset=TASKS, seed=4, reasoning_gym={"size": 5}))
    assert [p.label for p in other] != [p.label for p in prompts]
    custom = load_prompts(two_tasks(answer_format="Answer as ANSWER=x."))[0]
    assert custom.messages[-1]["content"].endswith("\n\nAnswer as ANSWER=x.")


def test_the_stream_resumes_at_its_cursor():
    prompts = load_prompts(two_tasks())
    stream = PromptStream(prompts, shuffle=True, seed=3)
    stream.next_batch(7)
    cursor = stream.checkpoint()
    expected = [p.index for p in stream.next_batch(6)]
    resumed = PromptStream(load_prompts(two_tasks()), shuffle=True, seed=3)
    resumed.restore(cursor)
    assert [p.index for p in resumed.next_batch(6)] == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dataset": "reasoning_gym:chain_summ"}, "close names: chain_sum, decimal_chain_sum"),
        ({"dataset": "reasoning_gym:composite"}, "unknown reasoning-gym task 'composite'"),
        (
            {"dataset": TASKS, "reasoning_gym": {"tasks": {"chain_sum": {"bogus": 1}}}},
            "reasoning_gym.tasks.chain_sum: TypeError",
        ),
        (
            {"dataset": TASKS, "reasoning_gym": {"tasks": {"gcd": {}}}},
            "reasoning_gym.tasks.gcd configures a task",
        ),
    ],
)
def test_unknown_tasks_and_bad_task_configs_are_refused_before_any_process(fields, message):
    """Checked against the library by read_inputs (the config layer does not import it)."""
    data = DataConfig(**fields)
    with pytest.raises(ConfigError, match=message) as refused:
        read_inputs(data, RewardConfig(sources=[{"name": "f", "function": "builtin:format"}]))
    assert refused.value.fields == ("data.dataset",)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dataset": "builtin:arithmetic", "reasoning_gym": {}}, "is not one: remove it"),
        ({"dataset": TASKS, "reasoning_gym": {"answer_pattern": "<a>.*</a>"}}, "needs a group"),
        ({"dataset": TASKS, "label_key": "x"}, "data.label_key names fields of a dataset file"),
    ],
)
def test_bad_tasks_and_task_configs_are_refused_when_the_config_is_read(fields, message):
    with pytest.raises(ValidationError, match=message):
        DataConfig(**fields)


@pytest.fixture(scope="module")
def rewards():
    rewards = Rewards(RewardConfig(sources=[{"name": "task", "function": "builtin:reasoning_gym"}]))
    yield rewards
    rewards.close()


def test_each_task_scores_its_own_answers_right_wrong_and_malformed(rewards):
    prompts = load_prompts(two_tasks())
    chain, basic = prompts[0], prompts[5]
    samples = [
        sample(chain, f"Adding up.\n<answer>{chain.label}</answer>"),
        sample(basic, f"<answer> {basic.label} </answer>"),
        sample(chain, f"<answer>{int(chain.label) + 1}</answer>"),
        sample(basic, f"the answer is {basic.label}"),  # no tags: malformed, nothing extracted
        sample(basic, "<answer>forty</answer>"),
    ]
    metrics = rewards.score(samples)
    assert [s.rewards["task"] for s in samples] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert metrics["reward/task/failed"] == 0 and metrics["reward/task/timeouts"] == 0


def test_a_row_that_is_not_a_reasoning_gym_row_fails_the_source_by_name(rewards):
    plain = Sample(0, "What is 1 + 1?", "2", [1], [2], [0.0], "<answer>2</answer>", "1")
    right = sample(load_prompts(two_tasks())[0], "x")
    metrics = rewards.score([plain, right])
    assert metrics["reward/task/failed"] == 1 and not plain.valid and right.valid


def test_the_extraction_follows_the_rows_answer_pattern(rewards):
    prompt = load_prompts(two_tasks(answer_pattern=r"ANSWER=(\S+)"))[0]
    samples = [
        sample(prompt, f"ANSWER={prompt.label}"),
        sample(prompt, f"<answer>{prompt.label}</answer>"),
    ]
    rewards.score(samples)
    assert [s.rewards["task"] for s in samples] == [1.0, 0.0]


class WordTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return " ".join(m["content"] for m in messages)

    def encode(self, text, add_special_tokens):
        return list(range(len(text.split())))


def test_evaluation_reports_pass_at_k_per_task(rewards):
    config = EvalConfig(
        data={"dataset": TASKS, "reasoning_gym": {"size": 2}},
        sampling={"n_samples": 2, "temperature": 1.0},
        pass_k=(1, 2),
    )
    evaluation = Evaluation(config, WordTokenizer(), DataConfig(max_prompt_tokens=512))
    prompts = [p for p, _ in evaluation.prompts]
    # chain_sum: prompt 0 right twice, prompt 1 once; basic_arithmetic: never right
    right = [[True, True], [True, False], [False, False], [False, False]]
    samples = [
        sample(p, f"<answer>{p.label if ok else 'no'}</answer>")
        for p, oks in zip(prompts, right, strict=True)
        for ok in oks
    ]
    out = evaluation.summarize(samples, rewards.score(samples))
    assert out["eval/chain_sum/pass@1"] == 0.75 and out["eval/chain_sum/pass@2"] == 1.0
    assert out["eval/basic_arithmetic/pass@1"] == 0.0
    assert out["eval/chain_sum/reward"] == 0.75 and out["eval/pass@1"] == 0.375
    assert out["eval/reward/task/timeouts"] == 0


def test_read_inputs_refuses_the_reasoning_gym_reward_on_other_data():
    reward = RewardConfig(sources=[{"name": "task", "function": "builtin:reasoning_gym"}])
    with pytest.raises(ConfigError, match=r"\bdata.dataset is builtin:arithmetic"):
        read_inputs(DataConfig(dataset="builtin:arithmetic"), reward)
    plain_eval = EvalConfig(data={"dataset": "builtin:arithmetic"})
    with pytest.raises(ConfigError, match="eval.data.dataset is builtin:arithmetic"):
        read_inputs(two_tasks(), reward, plain_eval)
    assert len(read_inputs(two_tasks(), reward).prompts) == 10


def test_evaluating_on_the_training_seed_is_refused():
    tiny = Path(__file__).parent / "reasoning_gym_tiny.yaml"
    assert load_config(tiny).eval.data.seed != load_config(tiny).data.seed
    with pytest.raises(ConfigError, match="eval.data.seed=0 equals data.seed"):
        load_config(tiny, ["eval.data.seed=0"])


def questions(config: DataConfig) -> set[str]:
    return {p.messages[-1]["content"] for p in load_prompts(config)}


def test_another_seed_draws_other_rows():
    # reasoning-gym seeds row i with seed + i: data seeds 0 and 1 shared 19 of 20 rows
    chain_sum = {"size": 20, "tasks": {"chain_sum": {"min_digits": 3, "max_digits": 4}}}
    train, held_out = (
        questions(DataConfig(dataset="reasoning_gym:chain_sum", seed=s, reasoning_gym=chain_sum))
        for s in (0, 1)
    )
    assert len(train) == len(held_out) == 20 and not train & held_out
    tiny = Path(__file__).parent / "reasoning_gym_tiny.yaml"
    with pytest.raises(ConfigError, match="differ by a multiple of 2048"):
        load_config(tiny, ["data.seed=1", "eval.data.seed=2049"])


def test_the_evaluation_leaves_out_questions_the_training_draws(rewards):
    # sums of two one-digit numbers: 200 questions, so another seed repeats many of them
    one_digit = {"tasks": {"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}}
    data = DataConfig(
        dataset="reasoning_gym:chain_sum", max_prompt_tokens=512, reasoning_gym=one_digit
    )
    config = EvalConfig(data={"dataset": "reasoning_gym:chain_sum", "reasoning_gym": one_digit})
    evaluation = Evaluation(config, WordTokenizer(), data)
    kept = {p.messages[-1]["content"] for p, _ in evaluation.prompts}
    assert evaluation.seen_in_training > 0 and kept and not kept & questions(data)
    assert len(evaluation.prompts) + evaluation.seen_in_training == 1000
    samples = [sample(p, "<answer>no</answer>") for p, _ in evaluation.prompts]
    out = evaluation.summarize(samples, rewards.score(samples))
    assert out["eval/skipped_training_prompts"] == evaluation.seen_in_training


def test_an_eval_set_the_training_asks_entirely_is_refused_before_the_start():
    # sums of two one-digit numbers: 2000 training rows ask all of the task's questions
    one_digit = {"tasks": {"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}}
    data = DataConfig(dataset="reasoning_gym:chain_sum", reasoning_gym={**one_digit, "size": 2000})
    config = EvalConfig(
        data={"dataset": "reasoning_gym:chain_sum", "reasoning_gym": {**one_digit, "size": 20}}
    )
    reward = RewardConfig(sources=[{"name": "task", "function": "builtin:reasoning_gym"}])
    with pytest.raises(ConfigError, match="every prompt is also a training prompt"):
        read_inputs(data, reward, config)
    # the evaluation leaves out the questions of the training prompts it is given (the run's,
    # read once), not of the training set generated again
    data = data.model_copy(update={"max_prompt_tokens": 512})
    training = load_prompts(data)
    with pytest.raises(ValueError, match="every prompt is also a training prompt"):
        Evaluation(config, WordTokenizer(), data, training)
    assert Evaluation(config, WordTokenizer(), data, training[:1]).seen_in_training < 20


def test_a_question_trained_on_is_left_out_whatever_answer_format_eval_asks_for(rewards):
    one_digit = {"tasks": {"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}}
    data = DataConfig(
        dataset="reasoning_gym:chain_sum",
        max_prompt_tokens=512,
        reasoning_gym={**one_digit, "size": 60},
    )
    other_format = {**one_digit, "size": 100, "answer_format": "Reply with the number only."}
    config = EvalConfig(
        data={"dataset": "reasoning_gym:chain_sum", "reasoning_gym": other_format},
        max_prompts=16,
    )
    evaluation = Evaluation(config, WordTokenizer(), data)
    assert evaluation.seen_in_training > 0  # the same questions, in another prompt
    assert len(evaluation.prompts) == 16  # the limit counts the held-out rows, not the dropped
