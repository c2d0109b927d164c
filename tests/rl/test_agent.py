"""Agentic rollouts: the OpenAI-compatible client records exactly the tokens the engine produced
(token in, token out), masks the conversation's own tokens, and rejects what it cannot record
exactly. Unit tests against a scripted engine, then a real SGLang engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import tiny_agent

from relax_launch.inference.images import ImagePolicy
from relax_launch.rl import agent
from relax_launch.rl.agent import AgentClient, as_dict
from relax_launch.rl.batch import to_batch
from relax_launch.rl.calculator import calculator, result_text
from relax_launch.rl.data import Prompt

QUESTION = Prompt(0, ({"role": "user", "content": "What is 3 + 4?"},), "7")


class CharTokenizer:
    """One token per character (ids are code points), with a ChatML template."""

    eos = "\x01"  # stands for <|im_end|>, a single special token

    def apply_chat_template(
        self, messages, tools=None, add_generation_prompt=False, tokenize=False
    ):
        text = "".join(f"<{m['role']}>{m['content']}{self.eos}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class ScriptedEngine:
    """Replies with the given texts in turn (the last with the stop token), recording requests."""

    def __init__(self, *texts: str, stop: bool = True) -> None:
        self.texts, self.stop, self.requests = list(texts), stop, []

    async def __call__(self, body):
        self.requests.append(body)
        text = self.texts.pop(0)
        ids = [ord(c) for c in text] + ([1] if self.stop else [])
        finish = {"type": "stop", "matched": 1} if self.stop else {"type": "length", "length": 5}
        meta = {"output_token_logprobs": [[-0.5, i, None] for i in ids], "finish_reason": finish}
        return {"text": text, "output_ids": ids, "meta_info": meta | {"weight_version": "3"}}


def run(coro):
    return asyncio.run(coro)


def test_two_turns_are_recorded_token_in_token_out():
    engine = ScriptedEngine("<calc>3+4</calc>", "Answer: 7")
    client = AgentClient(engine, CharTokenizer(), temperature=0.7, budget=200)
    conversation = run(calculator(QUESTION, client))
    t = client.trajectory
    assert [m.role if hasattr(m, "role") else m["role"] for m in conversation] == [
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert conversation[2]["content"] == "Calculator: 7"
    # the second turn is generated from the first request's ids + the engine's reply (its stop
    # token included) + the template's rendering of what came after, never re-tokenised
    first_out = [ord(c) for c in "<calc>3+4</calc>"] + [1]
    added = [ord(c) for c in "\n<user>Calculator: 7\x01\n<assistant>"]
    assert engine.requests[1]["input_ids"] == engine.requests[0]["input_ids"] + first_out + added
    assert t.prompt_ids == engine.requests[0]["input_ids"]
    assert t.ids == first_out + added + [ord(c) for c in "Answer: 7"] + [1]
    assert t.mask == [1.0] * len(first_out) + [0.0] * len(added) + [1.0] * 10
    assert t.logprobs == [-0.5] * len(first_out) + [0.0] * len(added) + [-0.5] * 10
    assert engine.requests[0]["sampling_params"] == {"temperature": 0.7, "max_new_tokens": 200}
    assert t.turns == 2 and t.rejected is None


def test_the_sample_trains_only_the_engines_tokens():
    engine = ScriptedEngine("<calc>3+4</calc>", "Answer: 7")
    client = AgentClient(engine, CharTokenizer(), temperature=1.0, budget=200)
    conversation, outcome = run(agent.converse(calculator, QUESTION, client))
    sample = agent.to_sample(0, (QUESTION, []), client, conversation, outcome)
    assert sample.valid and sample.text == "Answer: 7" and sample.turns == 2
    batch = to_batch([sample], distill_coef=0.0)
    prompt = len(client.trajectory.prompt_ids)
    assert list(batch.loss_mask[0]) == [0.0] * prompt + client.trajectory.mask
    assert sample.weight_version == "3"


def test_an_edited_reply_rejects_the_sample_but_the_function_goes_on():
    engine = ScriptedEngine("hi", "more")
    client = AgentClient(engine, CharTokenizer(), temperature=1.0, budget=200)
    conversation, outcome = run(agent.converse(tiny_agent.edits_the_reply, QUESTION, client))
    sample = agent.to_sample(0, (QUESTION, []), client, conversation, outcome)
    assert sample.outcome == "rejected" and not sample.valid
    assert "not the previous one plus the reply" in client.trajectory.rejected
    # the second request was rendered afresh from the edited conversation
    assert engine.requests[1]["input_ids"] == [
        ord(c)
        for c in "<user>What is 3 + 4?\x01\n<assistant>hi!\x01\n<user>Go on.\x01\n<assistant>"
    ]


def test_the_budget_bounds_the_whole_conversation():
    engine = ScriptedEngine("<calc>1+1</calc>", stop=False)
    client = AgentClient(engine, CharTokenizer(), temperature=1.0, budget=20)
    conversation, outcome = run(agent.converse(calculator, QUESTION, client))
    assert outcome == "out_of_budget" and conversation is None
    assert engine.requests[0]["sampling_params"]["max_new_tokens"] == 20
    sample = agent.to_sample(0, (QUESTION, []), client, conversation, outcome)
    assert sample.valid and sample.text == "<calc>1+1</calc>"  # trained as far as it went


def test_tool_calls_come_back_as_openai_tool_calls():
    text = (
        'Let me. <tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>'
    )
    client = AgentClient(ScriptedEngine(text), CharTokenizer(), temperature=1.0, budget=200)
    reply = run(client.create(messages=list(QUESTION.messages), tools=[tiny_agent.CALCULATOR]))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me."
    call = choice.message.tool_calls[0]
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "3+4"}
    assert as_dict(choice.message) == client.reply  # what a user appends is what it returned
    with pytest.raises(TypeError, match="does not take"):
        run(client.create(messages=[], frequency_penalty=1.0))


def test_calculator_evaluates_arithmetic_only():
    assert [result_text(e) for e in ("3*(4+5)", "10/4", "-2-3")] == ["27", "2.5", "-5"]
    assert result_text("__import__('os')").startswith("error")
    assert result_text("1/0").startswith("error")


@pytest.mark.e2e
def test_two_turns_with_a_tool_on_a_real_engine_train_exactly_the_engines_tokens(
    tiny_server, tiny_model
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    replies = []

    class Engines:  # the controller's engine clients, reduced to one real engine
        images = ImagePolicy()  # gateway.images, for images user code makes

        def client(self, role):
            return self

        async def request(self, path, body, affinity_key=None):
            async with httpx.AsyncClient(timeout=60) as http:
                reply = (await http.post(f"{tiny_server.url}{path}", json=body)).json()
            replies.append((body, reply))
            return reply

        def run(self, coro, what):
            return asyncio.run(coro)

    ids = tokenizer.apply_chat_template(list(QUESTION.messages), add_generation_prompt=True)
    samples = agent.generate(
        Engines(),
        [(QUESTION, ids)],
        n=2,
        temperature=1.0,
        max_tokens=64,
        function=tiny_agent.two_turns,
        tokenizer=tokenizer,
    )
    assert len(samples) == 2 and len(replies) == 4
    for sample in samples:
        assert sample.valid and sample.turns == 2 and sample.outcome == ""
        full = sample.prompt_ids + sample.response_ids
        mine = [  # this conversation's requests: their context and reply start its tokens
            (b, r)
            for b, r in replies
            if full[: len(b["input_ids"]) + len(r["output_ids"])]
            == b["input_ids"] + r["output_ids"]
        ]
        (first_in, first), (second_in, second) = mine
        # the second turn saw exactly the first turn's context and reply, then the tool turn
        prefix = first_in["input_ids"] + first["output_ids"]
        assert second_in["input_ids"][: len(prefix)] == prefix
        # the trained sequence is the engine's last context and reply, token for token
        assert full == second_in["input_ids"] + second["output_ids"]
        engine_tokens = [
            t for t, m in zip(sample.response_ids, sample.response_mask, strict=True) if m
        ]
        assert engine_tokens == first["output_ids"] + second["output_ids"]
        engine_logprobs = [
            lp for lp, m in zip(sample.logprobs, sample.response_mask, strict=True) if m
        ]
        meta = (
            first["meta_info"]["output_token_logprobs"]
            + second["meta_info"]["output_token_logprobs"]
        )
        assert engine_logprobs == [float(lp) for lp, *_ in meta]
        tool_turn = tokenizer.decode(
            [t for t, m in zip(sample.response_ids, sample.response_mask, strict=True) if not m]
        )
        assert "Result: 7" in tool_turn  # the tool's result is in the sequence, masked


def test_a_function_that_fails_loses_its_sample_only():
    async def broken(prompt, client):
        raise KeyError("oops")

    client = AgentClient(ScriptedEngine(), CharTokenizer(), temperature=1.0, budget=200)
    conversation, outcome = run(agent.converse(broken, QUESTION, client))
    sample = agent.to_sample(0, (QUESTION, [1, 2]), client, conversation, outcome)
    assert outcome == "failed" and not sample.valid and sample.response_ids == []
    assert sample.prompt_ids == [1, 2] and sample.weight_version == "None"  # no turn, no version
