"""Rank 0 reads the eval prompts once: ``read_inputs`` reads and checks them before any process
starts, and the program's ``Evaluation`` takes those rows as read (``relax_launch/launch.py`` passes
them through ``rl_program``) instead of reading ``eval.data`` a second time."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

import relax_launch.rl.evaluation as evaluation_module
import relax_launch.rl.inputs as inputs_module
from relax_launch.config import load_config
from relax_launch.rl.config import RewardConfig
from relax_launch.rl.data import PromptStream
from relax_launch.rl.data_config import DataConfig, EvalConfig
from relax_launch.rl.evaluation import Evaluation
from relax_launch.rl.inputs import read_inputs
from relax_launch.rl.program import rl_context

REPO = Path(__file__).resolve().parents[2]

REWARD = RewardConfig(sources=[{"name": "f", "function": "builtin:format"}])


class WordTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return " ".join(m["content"] for m in messages)

    def encode(self, text, add_special_tokens):
        return list(range(len(text.split())))


def rows(path, first: int) -> str:
    lines = [json.dumps({"prompt": f"what is {n} + 1", "label": str(n + 1)}) for n in range(4)]
    path.write_text("\n".join(line.replace("what", f"q{first}") for line in lines))
    return str(path)


def test_the_eval_prompts_are_read_once_from_the_check_to_the_evaluation(tmp_path, monkeypatch):
    data = DataConfig(dataset=rows(tmp_path / "train.jsonl", 0))
    config = EvalConfig(data={"dataset": rows(tmp_path / "eval.jsonl", 1)})
    reads: list[str] = []
    for module in (inputs_module, evaluation_module):
        real = module.load_prompts

        def counted(source, real=real):
            reads.append(source.dataset)
            return real(source)

        monkeypatch.setattr(module, "load_prompts", counted)
    inputs = read_inputs(data, REWARD, config)
    evaluation = Evaluation(config, WordTokenizer(), data, inputs.prompts, rows=inputs.eval_prompts)
    assert reads.count(config.data.dataset) == 1 and reads.count(data.dataset) == 1
    assert [p for p, _ in evaluation.prompts] == inputs.eval_prompts
    assert len(inputs.eval_prompts) == 4 and len(inputs.prompts) == 4


def test_the_programs_evaluation_takes_the_rows_rank_0_read(tmp_path, monkeypatch):
    job = load_config(REPO / "tests" / "rl" / "split_tiny.yaml", [f"logging.dir={tmp_path}"])
    inputs = read_inputs(job.data, job.reward, job.eval)

    def read_again(source):
        raise AssertionError(f"{source.dataset} read a second time")

    monkeypatch.setattr(evaluation_module, "load_prompts", read_again)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path: WordTokenizer())
    stream = PromptStream(inputs.prompts, shuffle=False, seed=0)
    ctx = rl_context(job, SimpleNamespace(), stream, None, None, 0, inputs.eval_prompts)
    ctx.rewards.close()
    assert [p for p, _ in ctx.evaluation.prompts] == inputs.eval_prompts[: job.eval.max_prompts]
